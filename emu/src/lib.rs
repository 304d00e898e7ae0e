//! **efa-emu**: an EFA NIC in user space.
//!
//! This crate builds `libefa_emu.so`, a drop-in for rdma-core's `libibverbs.so.1` *and*
//! `libefa.so.1` (one file under both names): it exports the verbs and efadv functions that
//! libfabric, librdmacm and the `efa` crate's `efa` device import, with rdma-core's symbol
//! versions, and models an EFA device behind them (`docs/emulator.md` in the repository says
//! what it models and what it does not). Datagrams travel over the `efa` crate's SRD-over-UDP
//! (its `udp` device), so an emulated NIC and the `udp` device reach each other.
//!
//! Run a program on it with the launcher: `efa-emu run -- fi_pingpong -p efa ...`.
#![allow(clippy::missing_safety_doc)]

pub mod abi;
pub mod config;
pub mod cq;
pub mod dmabuf;
pub mod efadv;
pub mod nic;
pub mod pace;
pub mod poll;
pub mod qp;
pub mod sysfs;
pub mod verbs;
pub mod wr;

// Each exported function is `emu_<name>`; these directives give it rdma-core's versioned name
// (the version nodes are in efa-emu.map, passed to the linker by build.rs).
std::arch::global_asm!(
    ".symver emu_ibv_create_comp_channel, ibv_create_comp_channel@@IBVERBS_1.0",
    ".symver emu_ibv_destroy_comp_channel, ibv_destroy_comp_channel@@IBVERBS_1.0",
    ".symver emu_ibv_copy_path_rec_from_kern, ibv_copy_path_rec_from_kern@@IBVERBS_1.0",
    ".symver emu_ibv_copy_qp_attr_from_kern, ibv_copy_qp_attr_from_kern@@IBVERBS_1.0",
    ".symver emu_ibv_get_sysfs_path, ibv_get_sysfs_path@@IBVERBS_1.0",
    ".symver emu_ibv_read_sysfs_file, ibv_read_sysfs_file@@IBVERBS_1.0",
    ".symver emu_ibv_ack_cq_events, ibv_ack_cq_events@@IBVERBS_1.1",
    ".symver emu_ibv_alloc_pd, ibv_alloc_pd@@IBVERBS_1.1",
    ".symver emu_ibv_close_device, ibv_close_device@@IBVERBS_1.1",
    ".symver emu_ibv_create_ah, ibv_create_ah@@IBVERBS_1.1",
    ".symver emu_ibv_create_cq, ibv_create_cq@@IBVERBS_1.1",
    ".symver emu_ibv_create_qp, ibv_create_qp@@IBVERBS_1.1",
    ".symver emu_ibv_create_srq, ibv_create_srq@@IBVERBS_1.1",
    ".symver emu_ibv_dealloc_pd, ibv_dealloc_pd@@IBVERBS_1.1",
    ".symver emu_ibv_dereg_mr, ibv_dereg_mr@@IBVERBS_1.1",
    ".symver emu_ibv_destroy_ah, ibv_destroy_ah@@IBVERBS_1.1",
    ".symver emu_ibv_destroy_cq, ibv_destroy_cq@@IBVERBS_1.1",
    ".symver emu_ibv_destroy_qp, ibv_destroy_qp@@IBVERBS_1.1",
    ".symver emu_ibv_destroy_srq, ibv_destroy_srq@@IBVERBS_1.1",
    ".symver emu_ibv_fork_init, ibv_fork_init@@IBVERBS_1.1",
    ".symver emu_ibv_free_device_list, ibv_free_device_list@@IBVERBS_1.1",
    ".symver emu_ibv_get_cq_event, ibv_get_cq_event@@IBVERBS_1.1",
    ".symver emu_ibv_get_device_list, ibv_get_device_list@@IBVERBS_1.1",
    ".symver emu_ibv_get_device_name, ibv_get_device_name@@IBVERBS_1.1",
    ".symver emu_ibv_modify_qp, ibv_modify_qp@@IBVERBS_1.1",
    ".symver emu_ibv_open_device, ibv_open_device@@IBVERBS_1.1",
    ".symver emu_ibv_query_device, ibv_query_device@@IBVERBS_1.1",
    ".symver emu_ibv_query_gid, ibv_query_gid@@IBVERBS_1.1",
    ".symver emu_ibv_query_pkey, ibv_query_pkey@@IBVERBS_1.1",
    ".symver emu_ibv_query_port, ibv_query_port@@IBVERBS_1.1",
    ".symver emu_ibv_reg_mr, ibv_reg_mr@@IBVERBS_1.1",
    ".symver emu_ibv_wc_status_str, ibv_wc_status_str@@IBVERBS_1.1",
    ".symver emu_ibv_attach_mcast, ibv_attach_mcast@@IBVERBS_1.1",
    ".symver emu_ibv_copy_ah_attr_from_kern, ibv_copy_ah_attr_from_kern@@IBVERBS_1.1",
    ".symver emu_ibv_detach_mcast, ibv_detach_mcast@@IBVERBS_1.1",
    ".symver emu_ibv_get_device_guid, ibv_get_device_guid@@IBVERBS_1.1",
    ".symver emu_ibv_query_qp, ibv_query_qp@@IBVERBS_1.1",
    ".symver emu_ibv_get_pkey_index, ibv_get_pkey_index@@IBVERBS_1.5",
    ".symver emu_ibv_qp_to_qp_ex, ibv_qp_to_qp_ex@@IBVERBS_1.6",
    ".symver emu_ibv_reg_mr_iova, ibv_reg_mr_iova@@IBVERBS_1.7",
    ".symver emu_ibv_reg_mr_iova2, ibv_reg_mr_iova2@@IBVERBS_1.8",
    ".symver emu_ibv_get_device_index, ibv_get_device_index@@IBVERBS_1.9",
    ".symver emu_ibv_query_ece, ibv_query_ece@@IBVERBS_1.10",
    ".symver emu_ibv_set_ece, ibv_set_ece@@IBVERBS_1.10",
    ".symver emu_ibv_reg_dmabuf_mr, ibv_reg_dmabuf_mr@@IBVERBS_1.12",
    ".symver emu_ibv_is_fork_initialized, ibv_is_fork_initialized@@IBVERBS_1.13",
    ".symver emu_efadv_create_driver_qp, efadv_create_driver_qp@@EFA_1.0",
    ".symver emu_efadv_query_device, efadv_query_device@@EFA_1.1",
    ".symver emu_efadv_create_qp_ex, efadv_create_qp_ex@@EFA_1.1",
    ".symver emu_efadv_query_ah, efadv_query_ah@@EFA_1.1",
    ".symver emu_efadv_create_cq, efadv_create_cq@@EFA_1.2",
    ".symver emu_efadv_cq_from_ibv_cq_ex, efadv_cq_from_ibv_cq_ex@@EFA_1.2",
    ".symver emu_efadv_query_mr, efadv_query_mr@@EFA_1.3",
);

/// Every exported symbol with its version, for tests that compare with what programs import.
pub const EXPORTS: &[(&str, &str)] = &[
    ("ibv_create_comp_channel", "IBVERBS_1.0"),
    ("ibv_destroy_comp_channel", "IBVERBS_1.0"),
    ("ibv_copy_path_rec_from_kern", "IBVERBS_1.0"),
    ("ibv_copy_qp_attr_from_kern", "IBVERBS_1.0"),
    ("ibv_get_sysfs_path", "IBVERBS_1.0"),
    ("ibv_read_sysfs_file", "IBVERBS_1.0"),
    ("ibv_ack_cq_events", "IBVERBS_1.1"),
    ("ibv_alloc_pd", "IBVERBS_1.1"),
    ("ibv_close_device", "IBVERBS_1.1"),
    ("ibv_create_ah", "IBVERBS_1.1"),
    ("ibv_create_cq", "IBVERBS_1.1"),
    ("ibv_create_qp", "IBVERBS_1.1"),
    ("ibv_create_srq", "IBVERBS_1.1"),
    ("ibv_dealloc_pd", "IBVERBS_1.1"),
    ("ibv_dereg_mr", "IBVERBS_1.1"),
    ("ibv_destroy_ah", "IBVERBS_1.1"),
    ("ibv_destroy_cq", "IBVERBS_1.1"),
    ("ibv_destroy_qp", "IBVERBS_1.1"),
    ("ibv_destroy_srq", "IBVERBS_1.1"),
    ("ibv_fork_init", "IBVERBS_1.1"),
    ("ibv_free_device_list", "IBVERBS_1.1"),
    ("ibv_get_cq_event", "IBVERBS_1.1"),
    ("ibv_get_device_list", "IBVERBS_1.1"),
    ("ibv_get_device_name", "IBVERBS_1.1"),
    ("ibv_modify_qp", "IBVERBS_1.1"),
    ("ibv_open_device", "IBVERBS_1.1"),
    ("ibv_query_device", "IBVERBS_1.1"),
    ("ibv_query_gid", "IBVERBS_1.1"),
    ("ibv_query_pkey", "IBVERBS_1.1"),
    ("ibv_query_port", "IBVERBS_1.1"),
    ("ibv_reg_mr", "IBVERBS_1.1"),
    ("ibv_wc_status_str", "IBVERBS_1.1"),
    ("ibv_attach_mcast", "IBVERBS_1.1"),
    ("ibv_copy_ah_attr_from_kern", "IBVERBS_1.1"),
    ("ibv_detach_mcast", "IBVERBS_1.1"),
    ("ibv_get_device_guid", "IBVERBS_1.1"),
    ("ibv_query_qp", "IBVERBS_1.1"),
    ("ibv_get_pkey_index", "IBVERBS_1.5"),
    ("ibv_qp_to_qp_ex", "IBVERBS_1.6"),
    ("ibv_reg_mr_iova", "IBVERBS_1.7"),
    ("ibv_reg_mr_iova2", "IBVERBS_1.8"),
    ("ibv_get_device_index", "IBVERBS_1.9"),
    ("ibv_query_ece", "IBVERBS_1.10"),
    ("ibv_set_ece", "IBVERBS_1.10"),
    ("ibv_reg_dmabuf_mr", "IBVERBS_1.12"),
    ("ibv_is_fork_initialized", "IBVERBS_1.13"),
    ("efadv_create_driver_qp", "EFA_1.0"),
    ("efadv_query_device", "EFA_1.1"),
    ("efadv_create_qp_ex", "EFA_1.1"),
    ("efadv_query_ah", "EFA_1.1"),
    ("efadv_create_cq", "EFA_1.2"),
    ("efadv_cq_from_ibv_cq_ex", "EFA_1.2"),
    ("efadv_query_mr", "EFA_1.3"),
];
