//! Buffer plumbing shared by every endpoint kind: what a device (or the protocol engine) gets
//! for a send or receive buffer, and how the user's buffer is put back together afterwards.

use bytes::{Bytes, BytesMut};

use crate::cq::{Buffer, PostError, RecvBuf, SendBuf};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mr::{Access, MemoryRegion};

/// The bytes to send for `buf` (a region is checked for `SEND` access and copied: a device-only
/// region is refused with `NotSupported`).
pub(crate) fn send_bytes(buf: &SendBuf, domain: &Domain, op: &'static str) -> Result<Bytes> {
    match buf {
        SendBuf::Bytes(b) => Ok(b.clone()),
        SendBuf::Region(r) => {
            r.check_local(domain, Access::SEND, op)?;
            r.check_cpu(op)?;
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
    /// Scatter: a scratch buffer of the parts' total room went down; its data is cut into the
    /// parts in order at completion.
    Iov { parts: Vec<RecvBuf> },
}

impl RecvTarget {
    /// Splits a receive buffer into what goes down and what stays, reserving `prefix` bytes at
    /// the front (DGRAM `FI_MSG_PREFIX` mode). A region's data goes down into a scratch buffer
    /// that is copied into it at completion: of the region's room (`lazy` false, for a device
    /// that needs the room up front), or empty (`lazy`: the protocol engine grows it as data
    /// arrives, up to [`room`](RecvTarget::room)). A device-only region is taken only `lazy`
    /// (the engine may read a message straight into it; a message it cannot is refused at
    /// completion, [`RecvTarget::cpu_copy_refused`]), otherwise refused with `NotSupported`.
    /// Refusals hand the buffer back.
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
                let checked = r
                    .check_local(domain, Access::RECV, op)
                    .and_then(|()| if lazy { Ok(()) } else { r.check_cpu(op) });
                if let Err(error) = checked {
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

    /// A scatter receive (or read) into `parts` (at most `limit`; `BytesMut` parts offer their
    /// capacity, regions their length and need `need` access). Its room is
    /// [`room`](RecvTarget::room).
    pub(crate) fn prepare_iov(
        parts: Vec<RecvBuf>,
        domain: &Domain,
        need: Access,
        limit: usize,
        op: &'static str,
    ) -> Result<RecvTarget, PostError> {
        let regions = parts.iter().filter_map(|p| match p {
            RecvBuf::Bytes(_) => None,
            RecvBuf::Region(r) => Some(r),
        });
        let checked = check_iov(parts.len(), limit, regions, domain, need, op);
        match checked {
            Ok(()) => Ok(RecvTarget::Iov { parts }),
            Err(error) => Err(PostError {
                error,
                buf: Buffer::Iov(parts.into_iter().map(RecvBuf::into_buffer).collect()),
            }),
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
            RecvTarget::Iov { parts } => Some(parts.iter().map(part_room).sum()),
            _ => None,
        }
    }

    /// Bytes in front of the data (added to the completion's length).
    pub(crate) fn prefix(&self) -> usize {
        match self {
            RecvTarget::Direct | RecvTarget::Iov { .. } => 0,
            RecvTarget::Prefixed { head } => head.len(),
            RecvTarget::Region { offset, .. } => *offset,
        }
    }

    /// The refusal of a receive whose data (`down_len` bytes came up in `down`, of which those
    /// from `in_region` on were read into the region directly) would have to be copied into a
    /// device-only region with the CPU: `NotSupported` naming `op`. `None` when nothing needs
    /// copying (the whole message was read into the region by the device, or it is empty).
    pub(crate) fn cpu_copy_refused(
        &self,
        down_len: usize,
        in_region: Option<usize>,
        op: &'static str,
    ) -> Option<Error> {
        let RecvTarget::Region { region, offset } = self else {
            return None;
        };
        let n = down_len
            .min(region.len().saturating_sub(*offset))
            .min(in_region.unwrap_or(usize::MAX));
        (region.is_device_only() && n > 0).then(|| {
            crate::mem::device_only_error(op).with_detail(format!(
                "{n} bytes of the message came in packets (eager, medium, long-CTS, a runt or \
                 the same-host path) and would have to be copied into the device-only region \
                 with the CPU: it takes only messages the NIC reads into it (long-read, from a \
                 region the sender registered with REMOTE_READ); the message is dropped"
            ))
        })
    }

    /// Puts the user's buffer back together around what came up; a region receives a copy of
    /// the data when `filled` (only of its first `in_region` bytes when the rest was read into
    /// the region directly: `RecvDone::in_region`). Nothing is ever copied into a device-only
    /// region (see [`RecvTarget::cpu_copy_refused`]).
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
                if filled && !region.is_device_only() {
                    let n = down
                        .len()
                        .min(region.len() - offset)
                        .min(in_region.unwrap_or(usize::MAX));
                    crate::mem::copy::copy(&mut region.write()[offset..offset + n], &down[..n]);
                }
                Buffer::Region(region)
            }
            RecvTarget::Iov { parts } => {
                let mut rest = if filled { &down[..] } else { &[][..] };
                let parts = parts
                    .into_iter()
                    .map(|p| {
                        let n = part_room(&p).min(rest.len());
                        let (mine, after) = rest.split_at(n);
                        rest = after;
                        match p {
                            RecvBuf::Bytes(mut b) => {
                                if filled {
                                    b.clear();
                                    crate::mem::copy::extend(&mut b, mine);
                                }
                                Buffer::Recv(b)
                            }
                            RecvBuf::Region(mut r) => {
                                crate::mem::copy::copy(&mut r.write()[..n], mine);
                                Buffer::Region(r)
                            }
                        }
                    })
                    .collect();
                Buffer::Iov(parts)
            }
        }
    }

    /// What the endpoint still holds when the part that went down is lost to it.
    pub(crate) fn abandon(self) -> Buffer {
        match self {
            RecvTarget::Direct => Buffer::None,
            RecvTarget::Prefixed { head } => Buffer::Recv(head),
            RecvTarget::Region { region, .. } => Buffer::Region(region),
            RecvTarget::Iov { parts } => {
                Buffer::Iov(parts.into_iter().map(RecvBuf::into_buffer).collect())
            }
        }
    }
}

/// The room one part of a scatter offers.
fn part_room(p: &RecvBuf) -> usize {
    match p {
        RecvBuf::Bytes(b) => b.capacity(),
        RecvBuf::Region(r) => r.len(),
    }
}

/// Checks a scatter or gather of `n` parts: `InvalidArgument` for more than `limit`; each of its
/// `regions` must be of `domain`, grant `need` and be reachable by the CPU.
fn check_iov<'a>(
    n: usize,
    limit: usize,
    regions: impl Iterator<Item = &'a MemoryRegion>,
    domain: &Domain,
    need: Access,
    op: &'static str,
) -> Result<()> {
    if n > limit {
        return Err(Error::new(ErrorKind::InvalidArgument, op)
            .with_detail(format!("{n} buffers is more than iov_limit {limit}")));
    }
    for r in regions {
        r.check_local(domain, need, op)?;
        r.check_cpu(op)?;
    }
    Ok(())
}

/// The bytes of a gather (`send_iov`, `write_iov`): the parts copied one after another (a region
/// needs `need` access), or `InvalidArgument` for more than `limit` parts. Refusals hand the
/// parts back.
pub(crate) fn gather(
    parts: Vec<SendBuf>,
    domain: &Domain,
    need: Access,
    limit: usize,
    op: &'static str,
) -> Result<(Bytes, Vec<Buffer>), PostError> {
    let regions = parts.iter().filter_map(|p| match p {
        SendBuf::Bytes(_) => None,
        SendBuf::Region(r) => Some(r),
    });
    let checked = check_iov(parts.len(), limit, regions, domain, need, op);
    let mut out = BytesMut::new();
    if checked.is_ok() {
        out.reserve(parts.iter().map(SendBuf::len).sum());
        for p in &parts {
            match p {
                SendBuf::Bytes(b) => out.extend_from_slice(b),
                SendBuf::Region(r) => out.extend_from_slice(&r.read()),
            }
        }
    }
    let parts: Vec<Buffer> = parts.into_iter().map(SendBuf::into_buffer).collect();
    match checked {
        Ok(()) => Ok((out.freeze(), parts)),
        Err(error) => Err(PostError {
            error,
            buf: Buffer::Iov(parts),
        }),
    }
}
