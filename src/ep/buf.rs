//! Buffer plumbing shared by every endpoint kind: what a device (or the protocol engine) gets
//! for a send or receive buffer, and how the user's buffer is put back together afterwards.

use bytes::{Bytes, BytesMut};

use crate::cq::{Buffer, PostError, RecvBuf, SendBuf};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mr::{Access, MemoryRegion};

/// The bytes to send for `buf` (a region is checked for `SEND` access and copied).
pub(crate) fn send_bytes(buf: &SendBuf, domain: &Domain, op: &'static str) -> Result<Bytes> {
    match buf {
        SendBuf::Bytes(b) => Ok(b.clone()),
        SendBuf::Region(r) => {
            r.check_local(domain, Access::SEND, op)?;
            Ok(Bytes::copy_from_slice(&r.read()))
        }
    }
}

/// `InvalidArgument` for an inject of `len` bytes beyond the endpoint's `inject_size`.
pub(crate) fn check_inject(len: usize, inject_size: usize) -> Result<()> {
    if len > inject_size {
        return Err(
            Error::new(ErrorKind::InvalidArgument, "inject").with_detail(format!(
                "{len} bytes is more than inject_size {inject_size}"
            )),
        );
    }
    Ok(())
}

/// Where a receive lands once the device (or engine) hands its buffer back.
#[derive(Debug)]
pub(crate) enum RecvTarget {
    /// The user's buffer went down as is.
    Direct,
    /// The user's buffer is split: `head` holds the prefix area, the rest went down.
    Prefixed { head: BytesMut },
    /// A registered region: a scratch buffer went down and its data is copied in.
    Region { region: MemoryRegion, offset: usize },
}

impl RecvTarget {
    /// Splits a receive buffer into what goes down and what stays, reserving `prefix` bytes at
    /// the front (DGRAM `FI_MSG_PREFIX` mode). A region's data goes down into a scratch buffer
    /// that is copied into it at completion: of the region's room (`lazy` false, for a device
    /// that needs the room up front), or empty (`lazy`: the protocol engine grows it as data
    /// arrives, up to [`room`](RecvTarget::room)). Refusals hand the buffer back.
    pub(crate) fn prepare(
        buf: RecvBuf,
        domain: &Domain,
        prefix: usize,
        lazy: bool,
        op: &'static str,
    ) -> Result<(BytesMut, RecvTarget), PostError> {
        let refuse = |detail: String, buf: Buffer| PostError {
            error: Error::new(ErrorKind::InvalidArgument, op).with_detail(detail),
            buf,
        };
        match buf {
            RecvBuf::Bytes(b) if prefix == 0 => Ok((b, RecvTarget::Direct)),
            RecvBuf::Bytes(mut b) => {
                if b.capacity() < prefix {
                    let d = format!(
                        "prefix mode: buffer capacity {} is below the prefix size {prefix}",
                        b.capacity()
                    );
                    return Err(refuse(d, Buffer::Recv(b)));
                }
                b.clear();
                b.resize(prefix, 0);
                let tail = b.split_off(prefix);
                Ok((tail, RecvTarget::Prefixed { head: b }))
            }
            RecvBuf::Region(r) => {
                if let Err(error) = r.check_local(domain, Access::RECV, op) {
                    return Err(PostError {
                        error,
                        buf: Buffer::Region(r),
                    });
                }
                if r.len() < prefix {
                    return Err(refuse(
                        "prefix mode: region shorter than the prefix".into(),
                        Buffer::Region(r),
                    ));
                }
                let scratch = if lazy { 0 } else { r.len() - prefix };
                Ok((
                    BytesMut::with_capacity(scratch),
                    RecvTarget::Region {
                        region: r,
                        offset: prefix,
                    },
                ))
            }
        }
    }

    /// The part of a device-registered region the data goes to, for the device to read into
    /// directly (`RecvOp::local_region`).
    pub(crate) fn device_slice(&self) -> Option<crate::mem::RegionSlice> {
        match self {
            RecvTarget::Region { region, offset } => {
                let whole = region.device_slice()?;
                whole.sub(*offset, whole.len.checked_sub(*offset)?)
            }
            _ => None,
        }
    }

    /// The room of a region receive whose scratch buffer grows as data arrives (`None`: the
    /// buffer that went down has it as its capacity).
    pub(crate) fn room(&self) -> Option<usize> {
        match self {
            RecvTarget::Region { region, offset } => Some(region.len().saturating_sub(*offset)),
            _ => None,
        }
    }

    /// Bytes in front of the data (added to the completion's length).
    pub(crate) fn prefix(&self) -> usize {
        match self {
            RecvTarget::Direct => 0,
            RecvTarget::Prefixed { head } => head.len(),
            RecvTarget::Region { offset, .. } => *offset,
        }
    }

    /// Puts the user's buffer back together around what came up; a region receives a copy of
    /// the data when `filled` (only of its first `in_region` bytes when the rest was read into
    /// the region directly: `RecvDone::in_region`).
    pub(crate) fn finish(self, down: BytesMut, filled: bool) -> Buffer {
        self.finish_split(down, filled, None)
    }

    /// [`finish`](RecvTarget::finish) of a receive whose bytes from `in_region` on are in the
    /// region already.
    pub(crate) fn finish_split(
        self,
        down: BytesMut,
        filled: bool,
        in_region: Option<usize>,
    ) -> Buffer {
        match self {
            RecvTarget::Direct => Buffer::Recv(down),
            RecvTarget::Prefixed { mut head } => {
                head.unsplit(down);
                Buffer::Recv(head)
            }
            RecvTarget::Region { mut region, offset } => {
                if filled {
                    let n = down
                        .len()
                        .min(region.len() - offset)
                        .min(in_region.unwrap_or(usize::MAX));
                    region.write()[offset..offset + n].copy_from_slice(&down[..n]);
                }
                Buffer::Region(region)
            }
        }
    }

    /// What the endpoint still holds when the part that went down is lost to it.
    pub(crate) fn abandon(self) -> Buffer {
        match self {
            RecvTarget::Direct => Buffer::None,
            RecvTarget::Prefixed { head } => Buffer::Recv(head),
            RecvTarget::Region { region, .. } => Buffer::Region(region),
        }
    }
}
