//! [`Info`] printed as `fi_info` prints it (one line, or every attribute with `-v`).

use super::*;

impl fmt::Display for Info {
    /// The short form of `fi_info` (without `-v`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "provider: {}", self.provider)?;
        writeln!(f, "    fabric: {}", self.fabric)?;
        writeln!(f, "    domain: {}", self.domain)?;
        writeln!(f, "    version: {}", self.version)?;
        writeln!(f, "    type: {}", self.ep_type)?;
        write!(f, "    protocol: {}", self.protocol)
    }
}

/// Every attribute of an [`Info`], laid out like `fi_info -v`; from [`Info::verbose`].
#[derive(Clone, Copy, Debug)]
pub struct Verbose<'a>(pub(super) &'a Info);

impl fmt::Display for Verbose<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.0;
        let d = &i.device;
        let opt = |v: Option<String>| v.unwrap_or_else(|| "(null)".to_string());
        writeln!(f, "---")?;
        writeln!(f, "fi_info:")?;
        writeln!(f, "    caps: {}", i.caps)?;
        writeln!(f, "    mode: {}", i.mode)?;
        writeln!(f, "    addr_format: {}", i.addr_format)?;
        writeln!(f, "    src_addrlen: {}", i.addrlen)?;
        writeln!(f, "    src_addr: {}", RawAddr::new(d.gid, 0, 0))?;
        writeln!(f, "    fi_tx_attr:")?;
        writeln!(f, "        caps: {}", i.tx_attr.caps)?;
        writeln!(f, "        msg_order: {}", i.tx_attr.msg_order)?;
        writeln!(f, "        inject_size: {}", i.tx_attr.inject_size)?;
        writeln!(f, "        size: {}", i.tx_attr.size)?;
        writeln!(f, "        iov_limit: {}", i.tx_attr.iov_limit)?;
        writeln!(f, "        rma_iov_limit: {}", i.tx_attr.rma_iov_limit)?;
        writeln!(f, "    fi_rx_attr:")?;
        writeln!(f, "        caps: {}", i.rx_attr.caps)?;
        writeln!(f, "        msg_order: {}", i.rx_attr.msg_order)?;
        writeln!(f, "        size: {}", i.rx_attr.size)?;
        writeln!(f, "        iov_limit: {}", i.rx_attr.iov_limit)?;
        writeln!(
            f,
            "        total_buffered_recv: {}",
            i.rx_attr.total_buffered_recv
        )?;
        writeln!(f, "    fi_ep_attr:")?;
        writeln!(f, "        type: {}", i.ep_type)?;
        writeln!(f, "        protocol: {}", i.protocol)?;
        writeln!(f, "        protocol_version: {}", i.protocol_version)?;
        writeln!(f, "        max_msg_size: {}", i.ep_attr.max_msg_size)?;
        writeln!(f, "        msg_prefix_size: {}", i.ep_attr.msg_prefix_size)?;
        writeln!(f, "        mem_tag_format: {:#x}", i.ep_attr.mem_tag_format)?;
        writeln!(f, "        tx_ctx_cnt: {}", i.ep_attr.tx_ctx_cnt)?;
        writeln!(f, "        rx_ctx_cnt: {}", i.ep_attr.rx_ctx_cnt)?;
        let da = &i.domain_attr;
        writeln!(f, "    fi_domain_attr:")?;
        writeln!(f, "        name: {}", da.name)?;
        writeln!(f, "        threading: {}", da.threading)?;
        writeln!(f, "        progress: {}", da.progress)?;
        writeln!(f, "        control_progress: {}", da.control_progress)?;
        writeln!(f, "        resource_mgmt: {}", da.resource_mgmt)?;
        writeln!(f, "        av_type: {}", da.av_type)?;
        writeln!(f, "        mr_mode: {}", da.mr_mode)?;
        writeln!(f, "        mr_key_size: {}", da.mr_key_size)?;
        writeln!(f, "        cq_data_size: {}", da.cq_data_size)?;
        writeln!(f, "        mr_iov_limit: {}", da.mr_iov_limit)?;
        writeln!(f, "        caps: {}", da.caps)?;
        writeln!(f, "    fi_fabric_attr:")?;
        writeln!(f, "        name: {}", i.fabric)?;
        writeln!(f, "        prov_name: {}", i.provider)?;
        writeln!(f, "        prov_version: {}", i.version)?;
        writeln!(f, "    nic:")?;
        writeln!(f, "        fi_device_attr:")?;
        writeln!(f, "            name: {}", d.name)?;
        writeln!(f, "            kind: {}", d.kind)?;
        writeln!(f, "            gid: {}", d.gid)?;
        writeln!(f, "            max_send_wr: {}", d.max_send_wr)?;
        writeln!(f, "            max_recv_wr: {}", d.max_recv_wr)?;
        writeln!(f, "            max_sge: {}", d.max_sge)?;
        writeln!(f, "            inline_size: {}", d.inline_size)?;
        writeln!(f, "            max_rdma_size: {}", d.max_rdma_size)?;
        writeln!(f, "            rdma_read: {}", d.caps.rdma_read)?;
        writeln!(f, "            rdma_write: {}", d.caps.rdma_write)?;
        writeln!(
            f,
            "            unsolicited_write_recv: {}",
            d.caps.unsolicited_write_recv
        )?;
        writeln!(f, "            rnr_retry: {}", d.caps.rnr_retry)?;
        writeln!(f, "        fi_bus_attr:")?;
        writeln!(f, "            pci_addr: {}", opt(d.pci_addr.clone()))?;
        writeln!(
            f,
            "            numa_node: {}",
            opt(d.numa_node.map(|n| n.to_string()))
        )?;
        if let Some(dist) = i.distance {
            writeln!(f, "            distance: {dist}")?;
        }
        writeln!(f, "        fi_link_attr:")?;
        write!(f, "            mtu: {}", d.mtu)
    }
}

/// The largest RDM inject (`tx_attr.inject_size`): what fits one packet after the largest
/// header, at most the shm provider's inject size when shm transfer is on (as libfabric's EFA
/// provider reports it), and 0 when a packet holds less than a header's worth.
pub(crate) fn rdm_inject_size(device: &DeviceAttr, config: &Config) -> usize {
    let payload = device.mtu.saturating_sub(RDM_MAX_HDR_SIZE);
    let inject = if config.enable_shm_transfer {
        payload.min(SHM_MAX_INJECT_SIZE)
    } else {
        payload
    };
    if inject < RDM_MAX_HDR_SIZE { 0 } else { inject }
}
