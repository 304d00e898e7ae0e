//! Cross-memory attach (CMA): `process_vm_readv` / `process_vm_writev` copy between two
//! processes' address spaces in one step, the way libfabric's shm provider moves large messages
//! and serves RDMA read/write between processes on one host.
//!
//! The kernel allows it only when the caller may ptrace the target (`PTRACE_MODE_ATTACH`): same
//! user and, under Yama (`/proc/sys/kernel/yama/ptrace_scope`), scope 0, or scope 1 with the
//! caller an ancestor of the target or named by the target with `prctl(PR_SET_PTRACER)`. Scope 2
//! needs `CAP_SYS_PTRACE`, scope 3 forbids it. [`probe`] tells whether CMA towards a process is
//! permitted and, when it is not, says how to permit it.
//!
//! ```
//! use efa::device::shm::cma;
//! // This process may always read itself.
//! cma::probe(std::process::id()).unwrap();
//! let src = *b"copied by the kernel";
//! let mut dst = [0u8; 20];
//! let n = cma::read_remote(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
//! assert_eq!((n, &dst), (20, &src));
//! ```

#![allow(unsafe_code)]

use std::io;

use crate::error::{Error, ErrorKind, Result};

/// Where Yama keeps its ptrace restriction.
pub const PTRACE_SCOPE_PATH: &str = "/proc/sys/kernel/yama/ptrace_scope";

/// The Yama ptrace scope (0 classic, 1 restricted to descendants, 2 admin only, 3 none), or
/// `None` when Yama is not active on this kernel.
pub fn ptrace_scope() -> Option<u8> {
    std::fs::read_to_string(PTRACE_SCOPE_PATH)
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Checks whether this process may use CMA towards process `pid`.
///
/// It asks the kernel directly: a one-byte `process_vm_readv` from an address that is never
/// mapped. The permission check comes first, so `EFAULT` means "permitted", while `EPERM` means
/// ptrace rules forbid it. Errors:
///
/// * `ErrorKind::RemoteAccess`: not permitted; the detail names the fix (`sysctl
///   kernel.yama.ptrace_scope=0`, or let the target call [`allow_ptracer`] /
///   `prctl(PR_SET_PTRACER, <this pid>)`, or run as the same user);
/// * `ErrorKind::NotConnected`: no process `pid`;
/// * `ErrorKind::NotSupported`: the kernel (or a seccomp filter) does not offer CMA.
pub fn probe(pid: u32) -> Result<()> {
    let mut byte = [0u8; 1];
    // The first page is never mapped (vm.mmap_min_addr), so a permitted read fails with EFAULT.
    match read_remote(pid, 8, &mut byte) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EFAULT) => Ok(()),
        Err(e) => Err(explain(pid, e)),
    }
}

fn explain(pid: u32, e: io::Error) -> Error {
    let op = "cma_probe";
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            let scope = match ptrace_scope() {
                Some(s) => format!("kernel.yama.ptrace_scope is {s}"),
                None => "ptrace is restricted (no Yama; different user, or no CAP_SYS_PTRACE)"
                    .to_string(),
            };
            Error::new(ErrorKind::RemoteAccess, op)
                .with_detail(format!(
                    "cross-memory attach to pid {pid} not permitted: {scope}; fix with \
                     `sysctl kernel.yama.ptrace_scope=0`, or have pid {pid} call \
                     prctl(PR_SET_PTRACER, {me}) (efa::device::shm::cma::allow_ptracer), or run \
                     both processes as the same user with CAP_SYS_PTRACE",
                    me = std::process::id()
                ))
                .with_source(e)
        }
        Some(libc::ESRCH) => Error::new(ErrorKind::NotConnected, op)
            .with_detail(format!("no process {pid}"))
            .with_source(e),
        Some(libc::ENOSYS) => Error::new(ErrorKind::NotSupported, op)
            .with_detail("process_vm_readv is not available (kernel without CMA or seccomp)")
            .with_source(e),
        _ => Error::io(op, e),
    }
}

/// Copies `dst.len()` bytes from address `addr` of process `pid` into `dst`, returning how many
/// were copied (fewer when the remote range ends in an unmapped page).
///
/// This is safe: the kernel writes only into `dst`, and a bad remote address is an error, never
/// a fault in this process.
pub fn read_remote(pid: u32, addr: u64, dst: &mut [u8]) -> io::Result<usize> {
    let p = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    if dst.is_empty() {
        return Ok(0);
    }
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: `local` describes `dst`, a valid exclusive buffer of `iov_len` bytes that lives
    // across the call; the kernel writes at most that many bytes into it. The remote iovec is
    // only interpreted in the other process's address space (checked by the kernel).
    let n = unsafe { libc::process_vm_readv(p, &local, 1, &remote, 1, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Appends up to `len` bytes from address `addr` of process `pid` to `buf` (reserving room
/// first), returning how many were appended: fewer when the remote range ends in an unmapped
/// page. Unlike [`read_remote`] it needs no initialised destination, so a large read does not
/// pay for zeroing the buffer first.
///
/// Safe for the same reason: the kernel writes only into the reserved spare capacity of `buf`,
/// and `buf`'s length grows only by the count the kernel reports.
pub fn read_remote_into(
    pid: u32,
    addr: u64,
    len: usize,
    buf: &mut bytes::BytesMut,
) -> io::Result<usize> {
    let p = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    if len == 0 {
        return Ok(0);
    }
    buf.reserve(len);
    let spare = buf.spare_capacity_mut();
    let local = libc::iovec {
        iov_base: spare.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` describes the first `len` bytes of `buf`'s spare capacity (at least
    // `len` after `reserve`), memory `buf` owns exclusively for the duration of the call; the
    // kernel writes at most `len` bytes there. The remote iovec is only interpreted in the
    // other process's address space (checked by the kernel).
    let n = unsafe { libc::process_vm_readv(p, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = (n as usize).min(len);
    // SAFETY: the kernel initialised the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Reads the 8-byte word at `word_at` and then up to `len` bytes at `addr` of process `pid`,
/// in one `process_vm_readv`: the word is returned (`None` when the kernel stopped before it
/// was whole), the bytes are appended to `buf` (fewer when the range ends in an unmapped page).
/// Safe for the same reasons as [`read_remote_into`].
pub fn read_remote_checked(
    pid: u32,
    word_at: u64,
    addr: u64,
    len: usize,
    buf: &mut bytes::BytesMut,
) -> io::Result<Option<u64>> {
    let p = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    let mut word = [0u8; 8];
    buf.reserve(len);
    let spare = buf.spare_capacity_mut();
    let local = [
        libc::iovec {
            iov_base: word.as_mut_ptr().cast(),
            iov_len: 8,
        },
        libc::iovec {
            iov_base: spare.as_mut_ptr().cast(),
            iov_len: len,
        },
    ];
    let remote = [
        libc::iovec {
            iov_base: word_at as usize as *mut libc::c_void,
            iov_len: 8,
        },
        libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len,
        },
    ];
    // SAFETY: the local iovecs describe `word` (8 bytes on this stack frame) and the first
    // `len` bytes of `buf`'s spare capacity (at least `len` after `reserve`), both exclusively
    // ours for the duration of the call; the kernel writes at most their lengths, in order.
    // The remote iovecs are only interpreted in the other process's address space.
    let n = unsafe { libc::process_vm_readv(p, local.as_ptr(), 2, remote.as_ptr(), 2, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    if n < 8 {
        return Ok(None);
    }
    let got = (n - 8).min(len);
    // SAFETY: the kernel initialised the first `got` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + got) };
    Ok(Some(u64::from_le_bytes(word)))
}

/// Lets process `pid` (or any process, with `None`) ptrace this one, and so use CMA towards it,
/// under Yama scope 1 (`prctl(PR_SET_PTRACER)`). Without Yama this is a harmless error.
pub fn allow_ptracer(pid: Option<u32>) -> Result<()> {
    let who: libc::c_ulong = match pid {
        Some(p) => libc::c_ulong::from(p),
        None => libc::PR_SET_PTRACER_ANY as libc::c_ulong,
    };
    // SAFETY: PR_SET_PTRACER takes an integer argument and touches no memory of ours.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_PTRACER,
            who,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Error::io("cma_allow_ptracer", io::Error::last_os_error()))
    }
}
