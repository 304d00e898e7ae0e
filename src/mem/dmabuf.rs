//! Dmabuf memory (GPU memory its driver exported; a memfd in tests): a region over a range of a
//! dmabuf, either **CPU-mapped** ([`RegionMem::dmabuf`]: the crate maps it shared, software
//! devices and the engine reach the bytes through the mapping) or **device-only**
//! ([`RegionMem::dmabuf_device_only`]: never mapped, only a NIC reaches its bytes, every CPU
//! access is refused with `NotSupported`), and the claims that keep two CPU-mapped regions off
//! the same bytes.

use std::sync::Arc;

use parking_lot::Mutex;

use super::RegionMem;
use super::store::{self, AddressRange, Store};
use crate::error::{Error, ErrorKind, Result};

/// The file ranges the CPU-mapped dmabuf regions of this process map: two regions over
/// overlapping bytes of one file would let two write guards alias them.
static DMABUF_CLAIMS: Mutex<Vec<ClaimedRange>> = Mutex::new(Vec::new());

/// Bytes `start..end` of the file whose (device, inode) is `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ClaimedRange {
    file: (u64, u64),
    start: u64,
    end: u64,
}

/// A range mapped by one dmabuf region; released when the region's memory goes.
#[derive(Debug)]
pub(super) struct DmabufClaim(ClaimedRange);

impl DmabufClaim {
    /// Claims `start..end` of `file`; `InvalidArgument` when a live region maps any of it.
    fn take(file: (u64, u64), start: u64, end: u64) -> Result<DmabufClaim> {
        let mut c = DMABUF_CLAIMS.lock();
        if let Some(o) = c
            .iter()
            .find(|o| o.file == file && o.start < end && start < o.end)
        {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "register_dmabuf").with_detail(format!(
                    "bytes {start}..{end} of this file overlap {}..{}, which another live \
                     region maps: two regions over the same bytes would alias their guards \
                     (split one region into slices instead)",
                    o.start, o.end
                )),
            );
        }
        let r = ClaimedRange { file, start, end };
        c.push(r);
        Ok(DmabufClaim(r))
    }
}

impl Drop for DmabufClaim {
    fn drop(&mut self) {
        let mut c = DMABUF_CLAIMS.lock();
        if let Some(i) = c.iter().position(|x| *x == self.0) {
            c.swap_remove(i);
        }
    }
}

/// A checked dmabuf range: the duplicated descriptor, its (device, inode), the end offset.
struct Checked {
    file: std::fs::File,
    id: (u64, u64),
    end: u64,
}

/// The checks both kinds of dmabuf region make, with `op` naming the registration.
fn check_range(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: usize,
    op: &'static str,
) -> Result<Checked> {
    let bad = |d: String| Error::new(ErrorKind::InvalidArgument, op).with_detail(d);
    if len == 0 {
        return Err(bad("empty range".into()));
    }
    let page = store::page_size();
    if !offset.is_multiple_of(page) {
        return Err(bad(format!(
            "offset {offset} is not a multiple of the page size ({page} bytes)"
        )));
    }
    let end = offset
        .checked_add(len as u64)
        .ok_or_else(|| bad(format!("offset {offset} + length {len} overflows")))?;
    let file = std::fs::File::from(
        fd.try_clone_to_owned()
            .map_err(|e| Error::io(op, e).with_detail("cannot duplicate the descriptor"))?,
    );
    let meta = file.metadata().map_err(|e| Error::io(op, e))?;
    let size = meta.len();
    // A dmabuf whose exporter reports no size (0) is checked by mmap (or the NIC) alone.
    if (meta.is_file() || size > 0) && end > size {
        return Err(bad(format!(
            "range {offset}..{end} is past the end of the file ({size} bytes)"
        )));
    }
    use std::os::unix::fs::MetadataExt;
    Ok(Checked {
        file,
        id: (meta.dev(), meta.ino()),
        end,
    })
}

impl RegionMem {
    /// A region's memory over `len` bytes at `offset` of the dmabuf `fd` (GPU memory exported
    /// by its driver; a memfd in tests), mapped shared for reading and writing: software devices
    /// and the engine reach the bytes through the mapping, devices with a NIC register the
    /// dmabuf itself ([`RegionMem::dmabuf_fd`]). Remote accesses name the mapping's address, as
    /// libfabric names a dmabuf region by its virtual address. The mapping goes when the region
    /// is closed.
    ///
    /// Errors: `InvalidArgument` for `len` 0, an `offset` that is not a multiple of the page
    /// size, or a range past the end of the file (mapping it would fault on first touch);
    /// `NotSupported` when the descriptor cannot be mapped (a dmabuf whose exporter has no CPU
    /// mapping, as most GPU memory: register it device-only,
    /// [`RegionMem::dmabuf_device_only`]), with the system's error.
    ///
    /// Another mapping of the same file (the GPU, another process) may write the bytes while a
    /// guard reads them, as a NIC's DMA may: what the guard then sees is unspecified, never
    /// other memory. Shrinking the file under the region is outside this contract (the process
    /// would fault on the lost pages, as it would with any shared mapping).
    pub fn dmabuf(
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> Result<Arc<RegionMem>> {
        let c = check_range(fd, offset, len, "register_dmabuf")?;
        let claim = DmabufClaim::take(c.id, offset, c.end)?;
        let mapped = store::SharedMapping::map(fd, offset, len).map_err(|e| {
            Error::new(ErrorKind::NotSupported, "register_dmabuf").with_detail(format!(
                "cannot map the dmabuf for the CPU ({e}): not CPU-mappable: register it \
                 device-only (Domain::register_dmabuf_device_only); a region of \
                 register_dmabuf needs a CPU mapping"
            ))
        })?;
        let addr = mapped.addr() as usize as u64;
        Ok(Arc::new(RegionMem {
            _claim: Some(claim),
            dmabuf: Some((std::os::fd::OwnedFd::from(c.file), offset)),
            ..RegionMem::over(addr, len, Store::Mapped(mapped))
        }))
    }

    /// A region's memory over `len` bytes at `offset` of the dmabuf `fd` that the crate never
    /// maps: only a NIC that registers the dmabuf itself reaches its bytes
    /// ([`Device::register_device_mem`](crate::device::Device::register_device_mem)); every
    /// CPU access ([`write_at`](RegionMem::write_at), [`read_into`](RegionMem::read_into), the
    /// region's guards, emulated RMA) is refused with `NotSupported`. Remote accesses name an
    /// address range reserved for it with no access (unique in the process, nothing behind it),
    /// as the iova of its registration. The descriptor is duplicated.
    ///
    /// Unlike CPU-mapped regions, two device-only regions may cover the same bytes (the same GPU
    /// buffer registered with two NICs): no guard can alias them.
    ///
    /// Errors: `InvalidArgument` as for [`RegionMem::dmabuf`]; the system's error when no
    /// address range is left to name it.
    pub fn dmabuf_device_only(
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> Result<Arc<RegionMem>> {
        const OP: &str = "register_dmabuf_device_only";
        let c = check_range(fd, offset, len, OP)?;
        let range = AddressRange::reserve(len).map_err(|e| {
            Error::io(OP, e).with_detail("cannot reserve an address range to name the region")
        })?;
        Ok(Arc::new(RegionMem {
            dmabuf: Some((std::os::fd::OwnedFd::from(c.file), offset)),
            device_only: true,
            ..RegionMem::over(range.addr(), len, Store::Device(range))
        }))
    }

    /// The dmabuf of this memory, as (descriptor, offset), for a device that registers
    /// dmabufs with its NIC (`ibv_reg_dmabuf_mr`, iova = [`RegionMem::addr`]); `None` for other
    /// memory.
    pub fn dmabuf_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        use std::os::fd::AsFd;
        self.dmabuf.as_ref().map(|(fd, off)| (fd.as_fd(), *off))
    }

    /// True for device-only memory ([`RegionMem::dmabuf_device_only`]): the CPU has no mapping
    /// of its bytes, only a NIC reaches them.
    pub fn is_device_only(&self) -> bool {
        self.device_only
    }

    /// `NotSupported` (naming `op`) for device-only memory: the CPU cannot read or write it.
    pub(crate) fn check_cpu(&self, op: &'static str) -> Result<()> {
        if self.device_only {
            return Err(device_only_error(op));
        }
        Ok(())
    }
}

/// The refusal of a CPU access to device-only memory by `op`.
pub(crate) fn device_only_error(op: &'static str) -> Error {
    Error::new(ErrorKind::NotSupported, op).with_detail(
        "the region is device-only (a dmabuf registered without a CPU mapping): only the NIC \
         reaches its bytes, by device RDMA or a read-based message protocol; this path would \
         copy them with the CPU",
    )
}
