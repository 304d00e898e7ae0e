//! Which descriptors `ibv_reg_dmabuf_mr` takes. The kernel takes a dma-buf only (a memfd gets
//! `EINVAL`), so the emulated NIC does too: a descriptor whose `/proc/self/fdinfo` entry names
//! an exporter (`exp_name:`), such as one `/dev/udmabuf` made from a sealed memfd. Where the
//! kernel has no exporter (CI machines without the `udmabuf` module), a **stand-in** is taken
//! too: a memfd whose name begins with [`STAND_IN`]. Only the emulated NIC takes it; a real NIC
//! refuses it like any memfd.

use std::os::raw::c_int;

/// The name prefix of a memfd the emulated NIC takes for a dma-buf (`memfd_create`'s name).
pub const STAND_IN: &str = "efa-emu-dmabuf-stand-in";

/// Whether `fd` is a dma-buf, or the marked stand-in.
pub fn accepted(fd: c_int) -> bool {
    is_dmabuf(fd) || is_stand_in(fd)
}

/// A dma-buf: its fdinfo names the exporter.
pub fn is_dmabuf(fd: c_int) -> bool {
    std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("exp_name:")))
}

/// A memfd named [`STAND_IN`]...: its link reads `/memfd:<name> (deleted)`.
pub fn is_stand_in(fd: c_int) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|p| {
        p.to_string_lossy()
            .starts_with(&format!("/memfd:{STAND_IN}"))
    })
}
