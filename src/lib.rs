//! # efa
//!
//! Safe, idiomatic reliable-datagram (RDM) and datagram (DGRAM) endpoints in the manner of
//! libfabric's EFA provider, on AWS Elastic Fabric Adapter hardware (cargo feature `efa`) and on
//! software devices (`udp`, `shm`, `loopback`) that behave like an EFA NIC, so the same program
//! runs and is tested on any Linux machine.
//!
//! The layers, top to bottom: discovery ([`getinfo`]) → [`Domain`] (memory registration, address
//! vectors, completion queues) → typed endpoints ([`Endpoint<Rdm>`](Endpoint),
//! [`Endpoint<Dgram>`](Endpoint)) → the RDM protocol engine ([`proto::engine`], EFA RDM wire
//! protocol v4, sans-I/O) → the device seam ([`device::Device`]) → devices.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector};
//!
//! # fn main() -> efa::Result<()> {
//! let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
//! let domain = Domain::open(&info)?;
//! let cq = CompletionQueue::new(&domain, 64)?;
//! let av = AddressVector::new(&domain);
//! let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
//! let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
//! let peer_b = av.insert(b.addr())?;
//! // Any size: this one goes as a long-CTS message, paced by the receiver.
//! let big = Bytes::from(vec![7u8; 300_000]);
//! b.recv(BytesMut::with_capacity(300_000), 1)?;
//! a.send(peer_b, big.clone(), 2)?;
//! let mut got = Vec::new();
//! while got.len() < 2 {
//!     cq.wait(&mut got, 8, Some(std::time::Duration::from_secs(5)))?;
//! }
//! let recv = got.iter().find(|c| c.context == 1).unwrap();
//! assert_eq!(recv.buf.as_recv().unwrap(), &big[..]);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]

/// Writes the builder-style setters of an option or configuration struct (docs/api-conventions.md):
/// `with_<field>(value) -> Self` for every public field, so a `#[non_exhaustive]` struct is built
/// outside the crate as `T::default().with_a(x).with_b(y)`. The `into` group takes anything that
/// converts into the field's type; the `some` group's fields are `Option`s whose setter takes the
/// value and stores `Some`.
macro_rules! with_setters {
    (
        $ty:ident {
            $( $set:ident => $field:ident: $t:ty ),* $(,)?
        }
        $( into { $( $iset:ident => $ifield:ident: $it:ty ),* $(,)? } )?
        $( some { $( $sset:ident => $sfield:ident: $st:ty ),* $(,)? } )?
    ) => {
        impl $ty {
            $(
                #[doc = concat!("Sets [`", stringify!($field), "`](Self::", stringify!($field), ").")]
                #[must_use]
                pub fn $set(mut self, value: $t) -> Self {
                    self.$field = value;
                    self
                }
            )*
            $($(
                #[doc = concat!("Sets [`", stringify!($ifield), "`](Self::", stringify!($ifield), ").")]
                #[must_use]
                pub fn $iset(mut self, value: impl Into<$it>) -> Self {
                    self.$ifield = value.into();
                    self
                }
            )*)?
            $($(
                #[doc = concat!("Sets [`", stringify!($sfield), "`](Self::", stringify!($sfield), ") to `Some(value)`.")]
                #[must_use]
                pub fn $sset(mut self, value: $st) -> Self {
                    self.$sfield = Some(value);
                    self
                }
            )*)?
        }
    };
}

/// Writes a builder's setters: `name(value) -> Self` stores `value` in the builder's field
/// `name`, or with `in inner` in the field `name` of the builder's field `inner`. Each setter keeps
/// its own docs; a field marked `=> Some` is an `Option` and gets `Some(value)`.
macro_rules! builder_setters {
    (
        $ty:ty, in $inner:ident {
            $( $(#[$m:meta])* $name:ident: $t:ty $(=> $some:ident)?; )*
        }
    ) => {
        impl $ty {
            $( builder_setters!(@setter [$inner] $(#[$m])* $name: $t $(=> $some)?); )*
        }
    };
    (
        $ty:ty {
            $( $(#[$m:meta])* $name:ident: $t:ty $(=> $some:ident)?; )*
        }
    ) => {
        impl $ty {
            $( builder_setters!(@setter [] $(#[$m])* $name: $t $(=> $some)?); )*
        }
    };
    (@setter [$($inner:ident)?] $(#[$m:meta])* $name:ident: $t:ty $(=> $some:ident)?) => {
        $(#[$m])*
        pub fn $name(mut self, value: $t) -> Self {
            self $(.$inner)? .$name = builder_setters!(@value value $($some)?);
            self
        }
    };
    (@value $v:ident Some) => {
        Some($v)
    };
    (@value $v:ident) => {
        $v
    };
}

/// What every bit set of the crate has (the `bit_set!` ones here and `info`'s `flags!`):
/// `empty`, `contains`, `is_empty`, `bits`, `|` and `|=`, for a tuple struct over `$bits`.
macro_rules! bit_ops {
    ($ty:ident: $bits:ty) => {
        impl $ty {
            /// The empty set.
            pub const fn empty() -> $ty {
                $ty(0)
            }

            /// True when every member of `other` is in `self`.
            pub const fn contains(self, other: $ty) -> bool {
                self.0 & other.0 == other.0
            }

            /// True when the set is empty.
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }

            /// The raw bits (libfabric's values).
            pub const fn bits(self) -> $bits {
                self.0
            }
        }

        impl std::ops::BitOr for $ty {
            type Output = $ty;
            fn bitor(self, o: $ty) -> $ty {
                $ty(self.0 | o.0)
            }
        }

        impl std::ops::BitOrAssign for $ty {
            fn bitor_assign(&mut self, o: $ty) {
                self.0 |= o.0;
            }
        }
    };
}

/// Declares one of the crate's small bit sets (`Access`, `CompletionFlags`, `CounterEvents`): the
/// struct (with the attributes given), its members as constants with their libfabric names,
/// `bit_ops!`, and a `Debug` that lists the members set as `[FI_A | FI_B]`.
macro_rules! bit_set {
    (
        $(#[$m:meta])*
        pub struct $ty:ident($bits:ty) {
            $( $(#[$cm:meta])* $c:ident = $v:expr => $s:literal; )*
        }
    ) => {
        $(#[$m])*
        pub struct $ty($bits);

        impl $ty {
            $( $(#[$cm])* pub const $c: $ty = $ty($v); )*

            const NAMES: &'static [($ty, &'static str)] = &[$(($ty::$c, $s)),*];
        }

        bit_ops!($ty: $bits);

        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let names: Vec<&str> = $ty::NAMES
                    .iter()
                    .filter(|(m, _)| self.contains(*m))
                    .map(|(_, n)| *n)
                    .collect();
                write!(f, "[{}]", names.join(" | "))
            }
        }
    };
}

/// `AsFd` and `AsRawFd` for a waitable object (`CompletionQueue`, `Counter`) whose
/// `inner.notifier` holds its wait descriptor (made by its `new`, which fails without one): the
/// descriptor its `wait_fd` returns.
macro_rules! wait_fd_impls {
    ($ty:ident) => {
        impl std::os::fd::AsFd for $ty {
            #[doc = concat!("[`", stringify!($ty), "::wait_fd`].")]
            fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
                self.inner.notifier.fd().expect(concat!(
                    "the wait descriptor is made by ",
                    stringify!($ty),
                    "::new, which fails without it"
                ))
            }
        }

        impl std::os::fd::AsRawFd for $ty {
            #[doc = concat!("[`", stringify!($ty), "::wait_fd`].")]
            fn as_raw_fd(&self) -> std::os::fd::RawFd {
                use std::os::fd::AsFd;
                self.as_fd().as_raw_fd()
            }
        }
    };
}

pub mod addr;
pub mod atomic;
pub mod av;
pub mod cntr;
pub mod config;
pub mod cq;
pub mod device;
pub mod domain;
pub mod ep;
pub mod error;
pub mod fault;
pub mod info;
mod local;
pub mod mem;
pub mod mr;
pub mod notify;
mod progress;
pub mod proto;
pub mod rail;
mod random;
mod shmem;
pub mod stats;
pub mod topo;

pub use addr::{Gid, RAW_ADDR_LEN, RawAddr};

/// The `bytes` crate the API takes and returns (`Bytes`, `BytesMut`), re-exported so a program
/// needs no second dependency of the same version.
pub use bytes;

#[doc = include_str!("../docs/getting-started.md")]
pub mod getting_started {}

/// The guides of the repository's `docs/` folder, one module each, compiled with the crate (as
/// rustls's manual is): their Rust examples build (and run, where they need no second process
/// or hardware) under `cargo test --doc`, and their links to items resolve under `cargo doc`
/// with warnings denied, so a guide cannot go on naming an API that changed. Start with
/// [`getting_started`].
///
/// Names a guide writes in backticks without a link (`Type::method`, `module::Item`) are
/// checked against the source by `tests/docs.rs`.
pub mod guide {
    // Using the crate.
    #[doc = include_str!("../docs/rdm.md")]
    pub mod rdm {}
    #[doc = include_str!("../docs/dgram.md")]
    pub mod dgram {}
    #[doc = include_str!("../docs/rma.md")]
    pub mod rma {}
    #[doc = include_str!("../docs/config.md")]
    pub mod config {}
    #[doc = include_str!("../docs/multi-nic.md")]
    pub mod multi_nic {}
    #[doc = include_str!("../docs/libfabric-map.md")]
    pub mod libfabric_map {}
    #[doc = include_str!("../docs/security.md")]
    pub mod security {}
    #[doc = include_str!("../docs/performance.md")]
    pub mod performance {}
    // The devices.
    #[doc = include_str!("../docs/efa-hardware.md")]
    pub mod efa_hardware {}
    #[doc = include_str!("../docs/udp-device.md")]
    pub mod udp_device {}
    #[doc = include_str!("../docs/shm-device.md")]
    pub mod shm_device {}
    #[doc = include_str!("../docs/loopback-device.md")]
    pub mod loopback_device {}
    // Inside the crate.
    #[doc = include_str!("../docs/protocol.md")]
    pub mod protocol {}
    #[doc = include_str!("../docs/architecture.md")]
    pub mod architecture {}
    #[doc = include_str!("../docs/emulator.md")]
    pub mod emulator {}
}

pub use atomic::{AtomicOp, AtomicType};
pub use config::Config;

pub use device::{DeviceKind, Status};

pub use av::{AddressVector, PeerId};
pub use cntr::{Counter, CounterEvents, CounterWait};
pub use cq::{
    Buffer, Completion, CompletionError, CompletionFlags, CompletionQueue, PostError, RecvBuf,
    SendBuf,
};
pub use domain::Domain;
pub use ep::{
    AtomicRequest, BatchError, Dgram, Endpoint, EndpointBuilder, EndpointKind, EndpointOptions,
    OpFuture, OpOutcome, ProgressCpu, Rdm, ReadRequest, RecvOptions, RmaAddr, RmaEmulation,
    SendOptions, SendRequest, WriteOptions, WriteRequest,
};
pub use error::{Error, ErrorKind, Result};
pub use fault::FaultConfig;
pub use info::{Caps, EpType, Hints, Info, getinfo};
pub use mr::{Access, IntoRegionBuf, MemoryRegion, RemoteKey};

pub use stats::{DeviceStats, EndpointStats};
