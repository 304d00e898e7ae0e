//! The parts of rdma-core's C ABI (`<infiniband/verbs.h>`, `<infiniband/efadv.h>`, rdma-core
//! v28 to current) that the emulator hands out or reads, declared by hand in their x86-64/aarch64
//! Linux layout. Only the fields the emulator touches carry names; the rest are placeholders of
//! the right size. `tests/layout.rs` checks every size and offset here against the installed
//! headers with a C compiler.
#![allow(non_camel_case_types, dead_code)]

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// A function pointer slot the emulator leaves empty (NULL).
pub type Slot = usize;

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

pub const IBV_NODE_UNSPECIFIED: c_int = 7;
pub const IBV_TRANSPORT_UNSPECIFIED: c_int = 5;

// enum ibv_qp_type
pub const IBV_QPT_UD: c_int = 4;
pub const IBV_QPT_DRIVER: c_int = 0xff;

// enum ibv_qp_state
pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_ERR: c_int = 6;

// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_QKEY: c_int = 1 << 6;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_CUR_STATE: c_int = 1 << 1;
pub const IBV_QP_EN_SQD_ASYNC_NOTIFY: c_int = 1 << 2;

// enum ibv_qp_init_attr_mask
pub const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

// enum ibv_qp_create_send_ops_flags
pub const IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1 << 0;
pub const IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
pub const IBV_QP_EX_WITH_SEND: u64 = 1 << 2;
pub const IBV_QP_EX_WITH_SEND_WITH_IMM: u64 = 1 << 3;
pub const IBV_QP_EX_WITH_RDMA_READ: u64 = 1 << 4;

// enum ibv_wr_opcode
pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_WR_RDMA_READ: c_int = 4;

// enum ibv_send_flags
pub const IBV_SEND_INLINE: c_uint = 1 << 3;

// enum ibv_wc_opcode
pub const IBV_WC_SEND: c_int = 0;
pub const IBV_WC_RDMA_WRITE: c_int = 1;
pub const IBV_WC_RDMA_READ: c_int = 2;
pub const IBV_WC_RECV: c_int = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_int = (1 << 7) + 1;

// enum ibv_wc_flags
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

// enum ibv_wc_status
pub const IBV_WC_SUCCESS: c_int = 0;
pub const IBV_WC_LOC_LEN_ERR: c_int = 1;
pub const IBV_WC_LOC_QP_OP_ERR: c_int = 2;
pub const IBV_WC_LOC_PROT_ERR: c_int = 4;
pub const IBV_WC_WR_FLUSH_ERR: c_int = 5;
pub const IBV_WC_BAD_RESP_ERR: c_int = 7;
pub const IBV_WC_REM_INV_REQ_ERR: c_int = 9;
pub const IBV_WC_REM_ACCESS_ERR: c_int = 10;
pub const IBV_WC_REM_OP_ERR: c_int = 11;
pub const IBV_WC_RNR_RETRY_EXC_ERR: c_int = 13;
pub const IBV_WC_REM_INV_RD_REQ_ERR: c_int = 15;
pub const IBV_WC_REM_ABORT_ERR: c_int = 16;
pub const IBV_WC_RESP_TIMEOUT_ERR: c_int = 20;
pub const IBV_WC_GENERAL_ERR: c_int = 21;

// enum ibv_create_cq_wc_flags
pub const IBV_WC_EX_WITH_BYTE_LEN: u64 = 1 << 0;
pub const IBV_WC_EX_WITH_IMM: u64 = 1 << 1;
pub const IBV_WC_EX_WITH_QP_NUM: u64 = 1 << 2;
pub const IBV_WC_EX_WITH_SRC_QP: u64 = 1 << 3;
pub const IBV_WC_EX_WITH_SLID: u64 = 1 << 4;
pub const IBV_WC_EX_WITH_SL: u64 = 1 << 5;
pub const IBV_WC_EX_WITH_DLID_PATH_BITS: u64 = 1 << 6;
pub const IBV_WC_STANDARD_FLAGS: u64 = 0x7f;

// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 1 << 3;
/// Flags from this bit up are optional: a device that does not know them ignores them.
pub const IBV_ACCESS_OPTIONAL_FIRST: c_int = 1 << 20;

// enum ibv_port_state, ibv_mtu, link layer
pub const IBV_PORT_ACTIVE: c_int = 4;
pub const IBV_MTU_4096: c_int = 5;
pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;

// enum ibv_fork_status
pub const IBV_FORK_DISABLED: c_int = 0;
pub const IBV_FORK_ENABLED: c_int = 1;
pub const IBV_FORK_UNNEEDED: c_int = 2;

/// `__VERBS_ABI_IS_EXTENDED`: `context.abi_compat` of a context with a `verbs_context` around it.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

// efadv.h
pub const EFADV_QP_DRIVER_TYPE_SRD: u32 = 0;
pub const EFADV_DEVICE_ATTR_CAPS_RDMA_READ: u32 = 1 << 0;
pub const EFADV_DEVICE_ATTR_CAPS_RNR_RETRY: u32 = 1 << 1;
pub const EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID: u32 = 1 << 2;
pub const EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE: u32 = 1 << 3;
pub const EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV: u32 = 1 << 4;
pub const EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV: u16 = 1 << 0;
pub const EFADV_WC_EX_WITH_SGID: u64 = 1 << 0;
pub const EFADV_WC_EX_WITH_IS_UNSOLICITED: u64 = 1 << 1;

#[repr(C)]
pub struct pthread_mutex_t(pub libc::pthread_mutex_t);
#[repr(C)]
pub struct pthread_cond_t(pub libc::pthread_cond_t);

/// `union ibv_gid`: 16 bytes, aligned as its `global` member (two 64-bit words).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
pub struct ibv_device {
    pub _ops: [Slot; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

#[repr(C)]
pub struct ibv_context_ops {
    pub _compat1: [Slot; 11],
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyFn>,
    pub _compat2: [Slot; 7],
    pub post_srq_recv: Slot,
    pub _compat3: [Slot; 4],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat4: [Slot; 5],
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

pub type QueryPortFn =
    unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;
pub type CreateCqExFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;
pub type CreateQpExFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp;

/// `struct verbs_context`: 38 operation slots (`query_port` first, `create_cq_ex` the 26th,
/// `create_qp_ex` the 34th), a placeholder, `sz`, then the `ibv_context` it extends.
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPortFn>,
    pub _slots1: [Slot; 24],
    pub create_cq_ex: Option<CreateCqExFn>,
    pub _slots2: [Slot; 7],
    pub create_qp_ex: Option<CreateQpExFn>,
    pub _slots3: [Slot; 4],
    pub _abi_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// Bytes of the old `struct _compat_ibv_port_attr` (up to `link_layer`), which the exported
/// `ibv_query_port` fills for callers built before the extended query.
pub const COMPAT_PORT_ATTR_LEN: usize = std::mem::offset_of!(ibv_port_attr, flags);

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

#[repr(C)]
pub struct ibv_rx_hash_conf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: ibv_rx_hash_conf,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

#[repr(C)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: wr_rdma,
    pub ud: wr_ud,
    pub _atomic: [u64; 4],
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// Immediate data, network byte order.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    pub _bind_mw_or_tso: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

pub type WrStartFn = unsafe extern "C" fn(*mut ibv_qp_ex);
pub type WrCompleteFn = unsafe extern "C" fn(*mut ibv_qp_ex) -> c_int;
pub type WrRdmaFn = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64);
pub type WrRdmaImmFn = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32);
pub type WrSendImmFn = unsafe extern "C" fn(*mut ibv_qp_ex, u32);
pub type WrUdAddrFn = unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_ah, u32, u32);
pub type WrInlineFn = unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, usize);
pub type WrInlineListFn = unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_data_buf);
pub type WrSgeFn = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32);
pub type WrSgeListFn = unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_sge);

#[repr(C)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Slot,
    pub wr_atomic_fetch_add: Slot,
    pub wr_bind_mw: Slot,
    pub wr_local_inv: Slot,
    pub wr_rdma_read: Option<WrRdmaFn>,
    pub wr_rdma_write: Option<WrRdmaFn>,
    pub wr_rdma_write_imm: Option<WrRdmaImmFn>,
    pub wr_send: Option<WrStartFn>,
    pub wr_send_imm: Option<WrSendImmFn>,
    pub wr_send_inv: Slot,
    pub wr_send_tso: Slot,
    pub wr_set_ud_addr: Option<WrUdAddrFn>,
    pub wr_set_xrc_srqn: Slot,
    pub wr_set_inline_data: Option<WrInlineFn>,
    pub wr_set_inline_data_list: Option<WrInlineListFn>,
    pub wr_set_sge: Option<WrSgeFn>,
    pub wr_set_sge_list: Option<WrSgeListFn>,
    pub wr_start: Option<WrStartFn>,
    pub wr_complete: Option<WrCompleteFn>,
    pub wr_abort: Option<WrStartFn>,
    pub wr_atomic_write: Slot,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

pub type StartPollFn = unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int;
pub type NextPollFn = unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int;
pub type EndPollFn = unsafe extern "C" fn(*mut ibv_cq_ex);
pub type ReadIntFn = unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int;
pub type ReadU32Fn = unsafe extern "C" fn(*mut ibv_cq_ex) -> u32;
pub type ReadU8Fn = unsafe extern "C" fn(*mut ibv_cq_ex) -> u8;

#[repr(C)]
pub struct ibv_cq_ex {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: Option<StartPollFn>,
    pub next_poll: Option<NextPollFn>,
    pub end_poll: Option<EndPollFn>,
    pub read_opcode: Option<ReadIntFn>,
    pub read_vendor_err: Option<ReadU32Fn>,
    pub read_byte_len: Option<ReadU32Fn>,
    pub read_imm_data: Option<ReadU32Fn>,
    pub read_qp_num: Option<ReadU32Fn>,
    pub read_src_qp: Option<ReadU32Fn>,
    pub read_wc_flags: Option<ReadU32Fn>,
    pub read_slid: Option<ReadU32Fn>,
    pub read_sl: Option<ReadU8Fn>,
    pub read_dlid_path_bits: Option<ReadU8Fn>,
    pub read_completion_ts: Slot,
    pub read_cvlan: Slot,
    pub read_flow_tag: Slot,
    pub read_tm_info: Slot,
    pub read_completion_wallclock_ns: Slot,
}

#[repr(C)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

#[repr(C)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
pub struct efadv_device_attr {
    pub comp_mask: u64,
    pub max_sq_wr: u32,
    pub max_rq_wr: u32,
    pub max_sq_sge: u16,
    pub max_rq_sge: u16,
    pub inline_buf_size: u16,
    pub inline_buf_size_ex: u16,
    pub device_caps: u32,
    pub max_rdma_size: u32,
}

#[repr(C)]
pub struct efadv_qp_init_attr {
    pub comp_mask: u64,
    pub driver_qp_type: u32,
    pub flags: u16,
    pub sl: u8,
    pub reserved: u8,
}

/// `struct efadv_mr_attr` (rdma-core 50, `efadv_query_mr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_mr_attr {
    pub comp_mask: u64,
    pub ic_id_validity: u16,
    pub recv_ic_id: u16,
    pub rdma_read_ic_id: u16,
    pub rdma_recv_ic_id: u16,
}

/// `efadv_mr_attr::ic_id_validity` bits.
pub const EFADV_MR_ATTR_VALIDITY_RECV_IC_ID: u16 = 1 << 0;
pub const EFADV_MR_ATTR_VALIDITY_RDMA_READ_IC_ID: u16 = 1 << 1;
pub const EFADV_MR_ATTR_VALIDITY_RDMA_RECV_IC_ID: u16 = 1 << 2;

#[repr(C)]
pub struct efadv_ah_attr {
    pub comp_mask: u64,
    pub ahn: u16,
    pub reserved: [u8; 6],
}

#[repr(C)]
pub struct efadv_cq_init_attr {
    pub comp_mask: u64,
    pub wc_flags: u64,
}

pub type ReadSgidFn = unsafe extern "C" fn(*mut efadv_cq, *mut ibv_gid) -> c_int;
pub type IsUnsolicitedFn = unsafe extern "C" fn(*mut efadv_cq) -> bool;

/// `struct efadv_cq` in its current layout (the first version ends after `wc_read_sgid`).
#[repr(C)]
pub struct efadv_cq {
    pub comp_mask: u64,
    pub wc_read_sgid: Option<ReadSgidFn>,
    pub wc_is_unsolicited: Option<IsUnsolicitedFn>,
}
