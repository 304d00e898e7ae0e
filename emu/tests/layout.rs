//! The hand-declared ABI (`src/abi.rs`) against rdma-core's installed headers: a C program
//! prints the size and field offsets of every struct the emulator shares with programs, and they
//! must equal Rust's. Needs a C compiler and `libibverbs-dev` (`.ci/run` installs it).

use std::mem::{offset_of, size_of};
use std::process::Command;

use efa_emu::abi::*;

macro_rules! rust_layout {
    ($($ty:ident { $($f:ident),* }),* $(,)?) => {
        vec![$(
            (format!("{} size", stringify!($ty)), size_of::<$ty>()),
            $((format!("{}.{}", stringify!($ty), stringify!($f)), offset_of!($ty, $f)),)*
        )*]
    };
}

macro_rules! c_layout {
    ($($ty:ident { $($f:ident),* }),* $(,)?) => {{
        let mut s = String::new();
        $(
            s.push_str(&format!("printf(\"%s size %zu\\n\", \"{0}\", sizeof(struct {0}));\n", stringify!($ty)));
            $(s.push_str(&format!(
                "printf(\"%s.%s %zu\\n\", \"{0}\", \"{1}\", offsetof(struct {0}, {1}));\n",
                stringify!($ty), stringify!($f)));)*
        )*
        s
    }};
}

macro_rules! both {
    ($($t:tt)*) => { (rust_layout!($($t)*), c_layout!($($t)*)) };
}

#[test]
fn abi_matches_rdma_core_headers() {
    let (rust, c_body) = both!(
        ibv_device {
            node_type,
            transport_type,
            name,
            dev_name,
            dev_path,
            ibdev_path
        },
        ibv_context {
            device,
            ops,
            cmd_fd,
            async_fd,
            num_comp_vectors,
            mutex,
            abi_compat
        },
        verbs_context {
            query_port,
            create_cq_ex,
            create_qp_ex,
            sz,
            context
        },
        ibv_device_attr {
            fw_ver,
            node_guid,
            max_mr_size,
            vendor_id,
            vendor_part_id,
            max_qp,
            max_sge,
            max_sge_rd,
            max_cq,
            max_mr,
            max_pd,
            max_ah,
            max_pkeys,
            phys_port_cnt
        },
        ibv_port_attr {
            state,
            max_mtu,
            gid_tbl_len,
            max_msg_sz,
            pkey_tbl_len,
            lid,
            active_width,
            active_speed,
            link_layer,
            flags,
            port_cap_flags2
        },
        ibv_pd { context, handle },
        ibv_mr {
            context,
            pd,
            addr,
            length,
            handle,
            lkey,
            rkey
        },
        ibv_ah {
            context,
            pd,
            handle
        },
        ibv_global_route {
            dgid,
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class
        },
        ibv_ah_attr {
            grh,
            dlid,
            sl,
            is_global,
            port_num
        },
        ibv_qp_cap {
            max_send_wr,
            max_recv_wr,
            max_send_sge,
            max_recv_sge,
            max_inline_data
        },
        ibv_qp_init_attr {
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all
        },
        ibv_qp_init_attr_ex {
            qp_context,
            cap,
            qp_type,
            comp_mask,
            pd,
            xrcd,
            create_flags,
            max_tso_header,
            rwq_ind_tbl,
            rx_hash_conf,
            source_qpn,
            send_ops_flags
        },
        ibv_qp_attr {
            qp_state,
            qkey,
            sq_psn,
            cap,
            ah_attr,
            pkey_index,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            rate_limit
        },
        ibv_sge { addr, length, lkey },
        ibv_send_wr {
            wr_id,
            next,
            sg_list,
            num_sge,
            opcode,
            send_flags,
            imm_data,
            wr,
            qp_type
        },
        ibv_recv_wr {
            wr_id,
            next,
            sg_list,
            num_sge
        },
        ibv_qp {
            context,
            qp_context,
            pd,
            send_cq,
            recv_cq,
            srq,
            handle,
            qp_num,
            state,
            qp_type,
            mutex,
            cond,
            events_completed
        },
        ibv_qp_ex {
            qp_base,
            comp_mask,
            wr_id,
            wr_flags,
            wr_rdma_read,
            wr_rdma_write,
            wr_rdma_write_imm,
            wr_send,
            wr_send_imm,
            wr_set_ud_addr,
            wr_set_inline_data,
            wr_set_inline_data_list,
            wr_set_sge,
            wr_set_sge_list,
            wr_start,
            wr_complete,
            wr_abort
        },
        ibv_comp_channel {
            context,
            fd,
            refcnt
        },
        ibv_cq {
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed
        },
        ibv_cq_ex {
            context,
            channel,
            cq_context,
            cqe,
            comp_mask,
            status,
            wr_id,
            start_poll,
            next_poll,
            end_poll,
            read_opcode,
            read_vendor_err,
            read_byte_len,
            read_imm_data,
            read_qp_num,
            read_src_qp,
            read_wc_flags,
            read_slid,
            read_sl,
            read_dlid_path_bits
        },
        ibv_cq_init_attr_ex {
            cqe,
            cq_context,
            channel,
            comp_vector,
            wc_flags,
            comp_mask,
            flags,
            parent_domain
        },
        ibv_wc {
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            imm_data,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index,
            slid,
            sl,
            dlid_path_bits
        },
        efadv_device_attr {
            comp_mask,
            max_sq_wr,
            max_rq_wr,
            max_sq_sge,
            max_rq_sge,
            inline_buf_size,
            device_caps,
            max_rdma_size
        },
        efadv_ah_attr { comp_mask, ahn },
    );
    let dir = tempfile::tempdir().expect("temporary directory");
    let src = dir.path().join("layout.c");
    let exe = dir.path().join("layout");
    std::fs::write(
        &src,
        format!(
            "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n#include <infiniband/efadv.h>\nint main(void) {{\n{c_body}return 0;\n}}\n"
        ),
    )
    .expect("write the probe");
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("a C compiler (cc) is needed for this test");
    assert!(
        cc.status.success(),
        "the probe did not compile (is libibverbs-dev installed?):\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&exe).output().expect("run the probe");
    let c: Vec<(String, usize)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect();
    assert_eq!(c.len(), rust.len(), "the probe printed every entry");
    let diffs: Vec<String> = rust
        .iter()
        .zip(&c)
        .filter(|(r, c)| r != c)
        .map(|(r, c)| format!("{}: rust {} C {}", r.0, r.1, c.1))
        .collect();
    assert!(diffs.is_empty(), "ABI differences:\n{}", diffs.join("\n"));
}
