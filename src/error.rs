//! Errors: one [`Error`] type carrying an [`ErrorKind`] that mirrors the libfabric errno set,
//! the name of the operation that failed, an optional detail and the underlying source.

use std::fmt;

/// The result type of every fallible call in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in the terms libfabric users know (`FI_E*`).
///
/// The enum is `#[non_exhaustive]`: match with a wildcard arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// `FI_EAGAIN`: a queue is full; progress the endpoint (poll its completion queue) and retry.
    Again,
    /// `FI_EMSGSIZE`: the message is larger than the endpoint or device allows.
    MsgSize,
    /// `FI_ETRUNC`: the receive buffer was shorter than the message; the rest was discarded.
    Truncated,
    /// `FI_ECANCELED`: the operation was cancelled (or flushed when its queue was closed).
    Canceled,
    /// `FI_ENORX`: receiver not ready — the peer had no receive buffer posted (RNR).
    NoRx,
    /// `FI_ENOTCONN`: the destination queue pair does not exist (bad destination QPN, unknown peer).
    NotConnected,
    /// `FI_EHOSTUNREACH`: the destination cannot be reached.
    Unreachable,
    /// `FI_ECONNABORTED`: the remote did not respond within the retry budget or aborted.
    ConnectionAborted,
    /// `FI_EACCES`/remote access error: bad key, out-of-bounds address or missing access right.
    RemoteAccess,
    /// `FI_EREMOTEIO`: the remote side reported an error status.
    RemoteIo,
    /// `FI_EFA_ERR_PEER_ABORTED`: the peer aborted the operation.
    PeerAborted,
    /// `FI_EINVAL`: a bad argument from the application.
    InvalidArgument,
    /// `FI_ENOSYS`/`FI_EOPNOTSUPP`: the device or endpoint does not support this.
    NotSupported,
    /// `FI_EADDRNOTAVAIL`: the peer address is not in the address vector (or was removed).
    UnknownPeer,
    /// `FI_ENODATA`: discovery found nothing matching the hints.
    NoData,
    /// `FI_ENOMSG`: a peek found no matching message.
    NoMessage,
    /// `FI_EAVAIL`: an error completion is waiting; read it with `read_err`.
    ErrorAvailable,
    /// `FI_ETIMEDOUT`: a wait ran out of time.
    TimedOut,
    /// `FI_EBUSY`: the object is still in use.
    Busy,
    /// `FI_ENOMEM`: out of a bounded resource.
    NoMemory,
    /// A configuration value (e.g. an `FI_EFA_*` environment variable) is invalid.
    Config,
    /// An operating-system I/O error.
    Io,
    /// The object (endpoint, device, peer) has been closed.
    Closed,
}

impl ErrorKind {
    /// The positive libfabric errno value (`FI_E*`) closest to this kind.
    pub fn fi_errno(self) -> i32 {
        match self {
            ErrorKind::Again => 11,
            ErrorKind::MsgSize => 90,
            ErrorKind::Truncated => 265,
            ErrorKind::Canceled => 125,
            ErrorKind::NoRx => 269,
            ErrorKind::NotConnected => 107,
            ErrorKind::Unreachable => 113,
            ErrorKind::ConnectionAborted => 103,
            ErrorKind::RemoteAccess => 13,
            ErrorKind::RemoteIo => 121,
            ErrorKind::PeerAborted => 125,
            ErrorKind::InvalidArgument => 22,
            ErrorKind::NotSupported => 95,
            ErrorKind::UnknownPeer => 99,
            ErrorKind::NoData => 61,
            ErrorKind::NoMessage => 42,
            ErrorKind::ErrorAvailable => 259,
            ErrorKind::TimedOut => 110,
            ErrorKind::Busy => 16,
            ErrorKind::NoMemory => 12,
            ErrorKind::Config => 22,
            ErrorKind::Io => 5,
            ErrorKind::Closed => 32,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ErrorKind::Again => "resource temporarily unavailable, try again",
            ErrorKind::MsgSize => "message too long",
            ErrorKind::Truncated => "message truncated",
            ErrorKind::Canceled => "operation canceled",
            ErrorKind::NoRx => "receiver not ready (no receive buffer posted)",
            ErrorKind::NotConnected => "destination queue pair not found",
            ErrorKind::Unreachable => "destination unreachable",
            ErrorKind::ConnectionAborted => "remote unresponsive or aborted",
            ErrorKind::RemoteAccess => "remote access error",
            ErrorKind::RemoteIo => "remote I/O error",
            ErrorKind::PeerAborted => "peer aborted the operation",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NotSupported => "operation not supported",
            ErrorKind::UnknownPeer => "unknown peer address",
            ErrorKind::NoData => "no matching device or endpoint",
            ErrorKind::NoMessage => "no matching message",
            ErrorKind::ErrorAvailable => "an error completion is available",
            ErrorKind::TimedOut => "timed out",
            ErrorKind::Busy => "resource busy",
            ErrorKind::NoMemory => "out of resources",
            ErrorKind::Config => "invalid configuration",
            ErrorKind::Io => "I/O error",
            ErrorKind::Closed => "closed",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// An error: its [`ErrorKind`], the operation that failed, a detail and the source, if any.
///
/// ```
/// use efa::{Error, ErrorKind};
/// let e = Error::new(ErrorKind::MsgSize, "send").with_detail("9000 bytes > MTU 8192");
/// assert_eq!(e.kind(), ErrorKind::MsgSize);
/// assert_eq!(e.to_string(), "send: message too long (9000 bytes > MTU 8192)");
/// ```
///
/// `{}` prints the operation, the kind and the detail; the underlying error (an OS error, say)
/// is [`source`](std::error::Error::source)'s, so error reporters print it once. `{:#}` prints
/// the whole chain:
///
/// ```
/// use efa::{Error, ErrorKind};
/// let os = std::io::Error::from_raw_os_error(12);
/// let e = Error::io("ibv_reg_mr", os).with_detail("1 MiB");
/// assert!(!e.to_string().contains("os error 12"));
/// assert!(format!("{e:#}").ends_with("(os error 12)"));
/// ```
///
/// It is one pointer wide (the parts live in a box), so `Result<T>` stays small on hot paths.
#[doc(alias = "fi_strerror")]
pub struct Error {
    inner: Box<Inner>,
}

#[derive(Debug)]
struct Inner {
    kind: ErrorKind,
    op: &'static str,
    detail: Option<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("Error")
            .field("kind", &i.kind)
            .field("op", &i.op)
            .field("detail", &i.detail)
            .field("source", &i.source)
            .finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        write!(f, "{}: {}", i.op, i.kind)?;
        if let Some(d) = &i.detail {
            write!(f, " ({d})")?;
        }
        // The source is `source()`'s: a chain printer (anyhow, eyre, `{:#}` below) prints it
        // once. The alternate form prints the chain itself.
        if f.alternate() {
            let mut s = std::error::Error::source(self);
            while let Some(e) = s {
                write!(f, ": {e}")?;
                s = e.source();
            }
        }
        Ok(())
    }
}

impl Error {
    /// A new error of `kind` raised by operation `op`.
    pub fn new(kind: ErrorKind, op: &'static str) -> Self {
        Error {
            inner: Box::new(Inner {
                kind,
                op,
                detail: None,
                source: None,
            }),
        }
    }

    /// Adds a human-readable detail.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.inner.detail = Some(detail.into());
        self
    }

    /// Adds the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.inner.source = Some(Box::new(source));
        self
    }

    /// An I/O error raised by `op`, keeping the OS error as the source.
    pub fn io(op: &'static str, e: std::io::Error) -> Self {
        let kind = match e.kind() {
            std::io::ErrorKind::WouldBlock => ErrorKind::Again,
            std::io::ErrorKind::TimedOut => ErrorKind::TimedOut,
            std::io::ErrorKind::InvalidInput => ErrorKind::InvalidArgument,
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotConnected => {
                ErrorKind::NotConnected
            }
            _ => ErrorKind::Io,
        };
        Error::new(kind, op).with_source(e)
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The operation that failed (`"send"`, `"mr_reg"`, `"FI_EFA_RECVWIN_SIZE"`, ...).
    pub fn op(&self) -> &'static str {
        self.inner.op
    }

    /// The detail text, if any.
    pub fn detail(&self) -> Option<&str> {
        self.inner.detail.as_deref()
    }
}

impl Clone for Error {
    /// Clones kind, operation and detail; the source is kept as text.
    fn clone(&self) -> Self {
        let i = &self.inner;
        let detail = match (&i.detail, &i.source) {
            (Some(d), Some(s)) => Some(format!("{d}: {s}")),
            (None, Some(s)) => Some(s.to_string()),
            (d, None) => d.clone(),
        };
        Error {
            inner: Box::new(Inner {
                kind: i.kind,
                op: i.op,
                detail,
                source: None,
            }),
        }
    }
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        let kind = match e.kind() {
            ErrorKind::Again => std::io::ErrorKind::WouldBlock,
            ErrorKind::TimedOut => std::io::ErrorKind::TimedOut,
            ErrorKind::InvalidArgument | ErrorKind::Config => std::io::ErrorKind::InvalidInput,
            ErrorKind::NotConnected => std::io::ErrorKind::NotConnected,
            ErrorKind::ConnectionAborted | ErrorKind::PeerAborted => {
                std::io::ErrorKind::ConnectionAborted
            }
            ErrorKind::NotSupported => std::io::ErrorKind::Unsupported,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    /// The values libfabric's `fi_errno.h` gives the `FI_E*` codes with no errno of their own
    /// (`FI_ETRUNC` 265, `FI_ENORX` 269: 270 was a slip, issue 28).
    #[test]
    fn libfabric_specific_errno_values() {
        use super::ErrorKind;
        assert_eq!(ErrorKind::Truncated.fi_errno(), 265);
        assert_eq!(ErrorKind::NoRx.fi_errno(), 269);
    }
}
