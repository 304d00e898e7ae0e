//! Which descriptors `ibv_reg_dmabuf_mr` takes. The kernel takes a dma-buf only (a memfd gets
//! `EINVAL`), so the emulated NIC does too: a descriptor whose `/proc/self/fdinfo` entry names
//! an exporter (`exp_name:`), such as one `/dev/udmabuf` made from a sealed memfd. Where the
//! kernel has no exporter (CI machines without the `udmabuf` module), a **stand-in** is taken
//! too: a memfd whose name begins with [`STAND_IN`]. Only the emulated NIC takes it; a real NIC
//! refuses it like any memfd.
//!
//! `EFA_EMU_DMABUF=unmappable` makes such memory a GPU's as the program sees it: the NIC may
//! reach it (it maps it for its DMA emulation), the program may not map it any more
//! ([`map_for_nic`]).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

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

/// What keeps the NIC's view of a registered dma-buf mapped while the registration lives.
pub enum NicMapping {
    /// The registration's own mapping of its range, unmapped at deregistration.
    Own(efa::mem::SharedMapping),
    /// A file made unmappable (`EFA_EMU_DMABUF=unmappable`): the NIC's mapping of the whole
    /// file, made before the seal and shared by every registration of it.
    Sealed(Arc<efa::mem::SharedMapping>),
}

/// The mappings of the files the NIC made unmappable, by (device, inode), kept for the life of
/// the process: once sealed, a file can never be mapped for writing again, and a later
/// registration of it (another range, or the same after a deregistration) needs the NIC's view.
static SEALED: Mutex<Vec<SealedFile>> = Mutex::new(Vec::new());

/// A sealed file's (device, inode) and the NIC's mapping of all of it.
type SealedFile = ((u64, u64), Arc<efa::mem::SharedMapping>);

/// Maps `len` bytes of `fd` at `offset` for the NIC's DMA emulation: the first byte of the
/// range, and what keeps it mapped. With `unmappable` (`EFA_EMU_DMABUF=unmappable`), a stand-in
/// memfd then becomes a GPU's memory: the NIC maps the whole file once and seals it with
/// `F_SEAL_FUTURE_WRITE`, so the program's new writable mappings (and `write`s) of it fail
/// from then on while the NIC's mapping works on; mappings the program made before stay (an
/// emulator cannot take them back). A stand-in created without `MFD_ALLOW_SEALING` is refused
/// with `EPERM` (the switch could not hold); a real dma-buf stays as its exporter made it.
/// Errors are errnos.
pub fn map_for_nic(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
    unmappable: bool,
) -> Result<(*mut u8, NicMapping), c_int> {
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EINVAL);
    if !unmappable || !is_stand_in(fd.as_raw_fd()) {
        let m = efa::mem::SharedMapping::map(fd, offset, len).map_err(errno)?;
        return Ok((m.addr(), NicMapping::Own(m)));
    }
    let meta = std::fs::File::from(fd.try_clone_to_owned().map_err(errno)?)
        .metadata()
        .map_err(errno)?;
    let id = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
    let mut sealed = SEALED.lock().unwrap_or_else(|p| p.into_inner());
    let whole = match sealed.iter().find(|(i, _)| *i == id) {
        Some((_, m)) => m.clone(),
        None => {
            let size = usize::try_from(meta.len()).map_err(|_| libc::EOVERFLOW)?;
            if size == 0 {
                return Err(libc::EINVAL);
            }
            let m = Arc::new(efa::mem::SharedMapping::map(fd, 0, size).map_err(errno)?);
            // SAFETY: fcntl on a descriptor the caller lent for this call.
            let rc = unsafe {
                libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE)
            };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                tracing::warn!(error = %e, "efa-emu: EFA_EMU_DMABUF=unmappable cannot seal this stand-in (create it with MFD_ALLOW_SEALING); registration refused");
                return Err(libc::EPERM);
            }
            sealed.push((id, m.clone()));
            m
        }
    };
    let end = usize::try_from(offset)
        .ok()
        .and_then(|o| o.checked_add(len).map(|e| (o, e)));
    match end {
        Some((o, e)) if e <= whole.len() => {
            // The range lies inside the NIC's mapping of the file.
            let p = whole.addr().wrapping_add(o);
            Ok((p, NicMapping::Sealed(whole)))
        }
        _ => Err(libc::EINVAL),
    }
}
