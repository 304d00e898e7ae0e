//! [`Info`]: one usable (device, endpoint type) with its attributes, as libfabric's EFA provider
//! reports them.

use super::*;

// Info
// ---------------------------------------------------------------------------------------------

/// One usable (device, endpoint type): what `fi_getinfo` returns, with the attributes the EFA
/// provider reports. Open a domain on it; `Display` prints it like `fi_info`,
/// [`verbose`](Info::verbose) like `fi_info -v`, serde serializes every attribute.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct Info {
    /// The device kind (`fi_info` "provider").
    pub provider: DeviceKind,
    /// Fabric name (the provider name).
    pub fabric: String,
    /// Domain name: the device name with `-rdm` or `-dgrm` appended, as EFA names them.
    pub domain: String,
    /// Provider version ([`PROVIDER_VERSION`]).
    pub version: &'static str,
    /// Endpoint type.
    pub ep_type: EpType,
    /// Capabilities.
    pub caps: Caps,
    /// Requirements on the application.
    pub mode: Mode,
    /// Address format: `FI_ADDR_EFA` (32-byte raw addresses).
    pub addr_format: &'static str,
    /// Bytes of an endpoint address.
    pub addrlen: usize,
    /// Wire protocol: `FI_PROTO_EFA`.
    pub protocol: &'static str,
    /// Protocol version: 4 for RDM (EFA RDM protocol v4), 1 for DGRAM (as libfabric reports).
    pub protocol_version: u32,
    /// Transmit attributes.
    pub tx_attr: TxAttr,
    /// Receive attributes.
    pub rx_attr: RxAttr,
    /// Endpoint attributes.
    pub ep_attr: EpAttr,
    /// Domain attributes.
    pub domain_attr: DomainAttr,
    /// The device's attributes (MTU, queue depths, PCI address, NUMA node, capabilities).
    pub device: DeviceAttr,
    /// The runtime configuration endpoints opened from this info use.
    pub config: Config,
    /// How to open the device.
    #[serde(skip)]
    pub spec: DeviceSpec,
    /// How far the device is from the target of [`Hints::near`]; `None` without that hint
    /// and for devices without a PCI location (`udp`, `shm`, `loopback`).
    pub distance: Option<Distance>,
    /// The device opened during discovery, shared by every domain opened on this info.
    #[serde(skip)]
    pub(super) handle: Option<Arc<dyn Device>>,
}

impl Info {
    /// The info of endpoint type `ep_type` on a device with attributes `device`, as the EFA
    /// provider builds it (`efa_prov_info_alloc` / `_for_rdm`). [`getinfo`] uses it; tests and
    /// tools can use it with hand-made attributes. It does not open the device:
    /// [`open_device`](Info::open_device) opens one from `spec`.
    ///
    /// DGRAM: caps `MSG|SEND|RECV|SOURCE|LOCAL_COMM|REMOTE_COMM`, `max_msg_size` = MTU, inject
    /// = the device's inline size, iov limit = its SGE count, no ordering, `FI_THREAD_DOMAIN`,
    /// `FI_RM_DISABLED`. RDM adds tagged, RMA, atomics, multi-receive, directed receive and
    /// delivery complete; unlimited messages, send-after-send order, iov limit 4,
    /// `FI_THREAD_SAFE`, `FI_RM_ENABLED`, sizes from `FI_EFA_TX_SIZE`/`FI_EFA_RX_SIZE`.
    /// Both use manual progress.
    pub fn for_device(
        kind: DeviceKind,
        device: &DeviceAttr,
        ep_type: EpType,
        config: Config,
        spec: DeviceSpec,
    ) -> Info {
        let caps = Info::ep_caps(ep_type);
        let iov = device.max_sge.max(1);
        let dev_tx = rounddown_pow2(device.max_send_wr);
        let dev_rx = rounddown_pow2(device.max_recv_wr / iov);
        let mr_base = MrMode::ALLOCATED | MrMode::PROV_KEY | MrMode::VIRT_ADDR;
        let domain_caps = Caps::LOCAL_COMM | Caps::REMOTE_COMM;
        let tx_caps = Caps::MSG | Caps::SEND;
        let rx_caps = Caps::MSG | Caps::RECV | Caps::SOURCE;
        let (tx_attr, rx_attr, ep_attr, domain_attr, protocol_version);
        match ep_type {
            EpType::Dgram => {
                let max_msg_size = device.mtu as u64;
                tx_attr = TxAttr {
                    caps: tx_caps,
                    size: dev_tx,
                    inject_size: device.inline_size,
                    iov_limit: device.max_sge,
                    rma_iov_limit: 0,
                    msg_order: MsgOrder::empty(),
                    max_msg_size,
                };
                rx_attr = RxAttr {
                    caps: rx_caps,
                    size: dev_rx,
                    iov_limit: device.max_sge,
                    msg_order: MsgOrder::empty(),
                    total_buffered_recv: 0,
                };
                ep_attr = EpAttr {
                    max_msg_size,
                    msg_prefix_size: 0,
                    mem_tag_format: 0,
                    tx_ctx_cnt: 1,
                    rx_ctx_cnt: 1,
                };
                domain_attr = (Threading::Domain, ResourceMgmt::Disabled, mr_base);
                protocol_version = 1;
            }
            EpType::Rdm => {
                let order = MsgOrder::SAS
                    | MsgOrder::ATOMIC_RAR
                    | MsgOrder::ATOMIC_RAW
                    | MsgOrder::ATOMIC_WAR
                    | MsgOrder::ATOMIC_WAW;
                let inject = rdm_inject_size(device, &config);
                let pick = |env: usize, dev: usize| if env > 0 { env } else { dev };
                tx_attr = TxAttr {
                    caps: tx_caps
                        | Caps::TAGGED
                        | Caps::RMA
                        | Caps::ATOMIC
                        | Caps::READ
                        | Caps::WRITE
                        | Caps::DELIVERY_COMPLETE
                        | Caps::HMEM,
                    size: pick(config.tx_size, dev_tx),
                    inject_size: inject,
                    iov_limit: RDM_IOV_LIMIT,
                    rma_iov_limit: 1,
                    msg_order: order,
                    max_msg_size: u64::MAX,
                };
                rx_attr = RxAttr {
                    caps: rx_caps
                        | Caps::TAGGED
                        | Caps::RMA
                        | Caps::ATOMIC
                        | Caps::REMOTE_READ
                        | Caps::REMOTE_WRITE
                        | Caps::MULTI_RECV
                        | Caps::DIRECTED_RECV
                        | Caps::HMEM,
                    size: pick(config.rx_size, dev_rx),
                    iov_limit: RDM_IOV_LIMIT,
                    msg_order: order,
                    total_buffered_recv: 0,
                };
                ep_attr = EpAttr {
                    max_msg_size: u64::MAX,
                    msg_prefix_size: 0,
                    mem_tag_format: TAG_GENERIC,
                    tx_ctx_cnt: 1,
                    rx_ctx_cnt: 1,
                };
                // FI_HMEM: device memory as dmabuf regions (`Domain::register_dmabuf`), which
                // must be registered (FI_MR_HMEM).
                domain_attr = (
                    Threading::Safe,
                    ResourceMgmt::Enabled,
                    mr_base | MrMode::HMEM,
                );
                protocol_version = 4;
            }
        }
        let domain = format!("{}{}", device.name, domain_suffix(ep_type));
        let (threading, resource_mgmt, mr_mode) = domain_attr;
        Info {
            provider: kind,
            fabric: kind.name().to_string(),
            domain: domain.clone(),
            version: PROVIDER_VERSION,
            ep_type,
            caps,
            mode: Mode::empty(),
            addr_format: "FI_ADDR_EFA",
            addrlen: crate::addr::RAW_ADDR_LEN,
            protocol: "FI_PROTO_EFA",
            protocol_version,
            tx_attr,
            rx_attr,
            ep_attr,
            domain_attr: DomainAttr {
                name: domain,
                threading,
                progress: Progress::Manual,
                control_progress: Progress::Manual,
                resource_mgmt,
                av_type: AvType::Table,
                mr_mode,
                mr_key_size: 8,
                cq_data_size: 4,
                mr_iov_limit: 1,
                caps: domain_caps,
            },
            device: device.clone(),
            config,
            spec,
            distance: None,
            handle: None,
        }
    }

    /// The capabilities an endpoint type offers on every device.
    pub fn ep_caps(ep_type: EpType) -> Caps {
        let dgram = Caps::MSG
            | Caps::SEND
            | Caps::RECV
            | Caps::SOURCE
            | Caps::LOCAL_COMM
            | Caps::REMOTE_COMM;
        match ep_type {
            EpType::Dgram => dgram,
            EpType::Rdm => {
                dgram
                    | Caps::TAGGED
                    | Caps::RMA
                    | Caps::ATOMIC
                    | Caps::READ
                    | Caps::WRITE
                    | Caps::REMOTE_READ
                    | Caps::REMOTE_WRITE
                    | Caps::MULTI_RECV
                    | Caps::DIRECTED_RECV
                    | Caps::DELIVERY_COMPLETE
                    | Caps::HMEM
            }
        }
    }

    /// Sets [`Mode::MSG_PREFIX`] and the 40-byte prefix on a DGRAM info (no effect on RDM).
    pub fn with_msg_prefix(mut self) -> Info {
        if self.ep_type == EpType::Dgram {
            self.mode |= Mode::MSG_PREFIX;
            self.ep_attr.msg_prefix_size = DGRAM_MSG_PREFIX_SIZE;
        }
        self
    }

    /// The device to open domains on: the one discovery opened, or a new one from
    /// [`spec`](Info::spec) for an info built with [`Info::for_device`].
    pub fn open_device(&self) -> Result<Arc<dyn Device>> {
        match &self.handle {
            Some(d) => Ok(d.clone()),
            None => self.spec.open_configured(&self.config),
        }
    }

    /// A displayable `fi_info -v`-style listing of every attribute.
    pub fn verbose(&self) -> Verbose<'_> {
        Verbose(self)
    }
}
