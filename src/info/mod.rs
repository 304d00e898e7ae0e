//! Discovery, as `fi_getinfo`: [`getinfo`] turns [`Hints`] into one [`Info`] per usable
//! (device, endpoint type), each with the attributes libfabric's EFA provider reports, printable
//! like `fi_info` ([`Info`]'s `Display`, [`Info::verbose`]) and serializable with serde.
//!
//! Devices are listed in this order: `efa` NICs (cargo feature `efa`), then `udp`, then `shm`
//! (Linux), then `loopback`. For each device, RDM (`Endpoint<Rdm>`) comes before DGRAM
//! (`Endpoint<Dgram>`); see [`Info::for_device`] for the attributes of each.
//!
//! ```
//! use efa::{Caps, EpType};
//!
//! let want: Caps = "FI_MSG, FI_SOURCE".parse().unwrap();
//! assert!(want.contains(Caps::MSG) && !want.contains(Caps::TAGGED));
//! assert_eq!(want.to_string(), "[ FI_MSG, FI_SOURCE ]");
//! assert_eq!("dgram".parse::<EpType>().unwrap(), EpType::Dgram);
//! assert_eq!(EpType::Rdm.to_string(), "FI_EP_RDM");
//! ```

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;
use std::sync::Arc;

use crate::addr::RawAddr;
use crate::config::Config;
use crate::device::registry::{self, Discovery, PROVIDERS, Provider, Query};
pub use crate::device::spec::DeviceSpec;
use crate::device::{Device, DeviceAttr, DeviceKind};
use crate::error::{Error, ErrorKind, Result};
use crate::topo::{Distance, Near, Topology};

/// The provider version `fi_info` prints: this crate's `major.minor`.
pub const PROVIDER_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION_MAJOR"),
    ".",
    env!("CARGO_PKG_VERSION_MINOR")
);

/// Bytes a libfabric EFA DGRAM application reserves in front of every buffer when it asks for
/// [`Mode::MSG_PREFIX`] (the UD GRH area).
pub const DGRAM_MSG_PREFIX_SIZE: usize = 40;

/// Largest RDM REQ packet header (bytes): base + raw address + CQ data + 4 RMA iovs.
pub(crate) const RDM_MAX_HDR_SIZE: usize = 168;
/// The shm provider's inject limit, which bounds RDM inject when shm transfer is on.
pub(crate) const SHM_MAX_INJECT_SIZE: usize = 4096;
/// RDM endpoints accept this many iovs per operation (segmentation in software).
pub(crate) const RDM_IOV_LIMIT: usize = 4;
/// `FI_TAG_GENERIC`.
pub(crate) const TAG_GENERIC: u64 = 0xaaaa_aaaa_aaaa_aaaa;

// ---------------------------------------------------------------------------------------------

mod attrs;
mod flags;
mod hints;
mod print;
mod record;

pub use attrs::*;
pub use flags::*;
pub use hints::*;
pub use print::*;
pub use record::*;

fn domain_suffix(ep_type: EpType) -> &'static str {
    match ep_type {
        EpType::Rdm => "-rdm",
        EpType::Dgram => "-dgrm",
    }
}

fn rounddown_pow2(n: usize) -> usize {
    match n {
        0 => 0,
        n => 1 << (usize::BITS - 1 - n.leading_zeros()),
    }
}

// ---------------------------------------------------------------------------------------------
// getinfo
// ---------------------------------------------------------------------------------------------

/// Lists every usable (device, endpoint type) that matches `hints`, like `fi_getinfo`.
///
/// Order: `efa` NICs (with the `efa` feature), then `udp` (bound to [`Hints::addr`], default
/// `127.0.0.1`), then `shm` (on Linux, segments in `/dev/shm`), then `loopback`; per device RDM
/// before DGRAM. The configuration is the hints' (validated) or [`Config::from_env`]; an invalid
/// `FI_EFA_*` value is returned as its `Config` error. Devices not allowed by `FI_EFA_IFACE` or
/// the domain hint, and endpoint types lacking a requested capability, are left out; when
/// nothing is left the error is `NoData`, naming what was asked. With [`Hints::near`], NICs
/// come first ordered by their distance from a GPU or NUMA node (see there).
#[doc(alias = "fi_getinfo")]
pub fn getinfo(hints: &Hints) -> Result<Vec<Info>> {
    let config = match &hints.config {
        Some(c) => {
            c.validate()?;
            c.clone()
        }
        None => Config::from_env()?,
    };
    let no_data = |why: String| Error::new(ErrorKind::NoData, "getinfo").with_detail(why);

    let providers: Vec<&Provider> = match hints.provider.as_deref() {
        None => PROVIDERS.iter().collect(),
        Some(p) => {
            let p = p.trim().to_ascii_lowercase();
            let Some(kind) = DeviceKind::ALL.into_iter().find(|k| k.name() == p) else {
                let known: Vec<&str> = DeviceKind::ALL.iter().map(|k| k.name()).collect();
                return Err(no_data(format!(
                    "no provider named {p:?} (known: {})",
                    known.join(", ")
                )));
            };
            let Some(provider) = registry::provider(kind) else {
                return Err(no_data(match kind {
                    DeviceKind::Efa => "the efa device needs the cargo feature `efa`".to_string(),
                    _ => format!("the {kind} device is not available in this release"),
                }));
            };
            vec![provider]
        }
    };

    // Endpoint types that are offered, wanted, and have the wanted caps.
    let ep_types: Vec<EpType> = [EpType::Rdm, EpType::Dgram]
        .into_iter()
        .filter(|t| hints.ep_type.is_none_or(|want| want == *t))
        .filter(|t| Info::ep_caps(*t).contains(hints.caps))
        .collect();
    if ep_types.is_empty() {
        return Err(no_data(hints.describe(&config)));
    }

    let mut out = Vec::new();
    let mut first_err = None;
    let mut notes: Vec<&'static str> = Vec::new();
    let query = Query {
        bind: hints.addr.unwrap_or(Ipv4Addr::LOCALHOST.into()),
        config: &config,
    };
    for p in providers {
        let devices = match (p.discover)(&query) {
            Discovery::Found(d) => d,
            Discovery::Nothing(why) => {
                notes.push(why);
                continue;
            }
            Discovery::Unavailable(e) => {
                tracing::warn!(device = %p.kind, error = %e, "getinfo: cannot open device; skipped");
                first_err.get_or_insert(e);
                continue;
            }
            Discovery::Fatal(e) => return Err(e),
        };
        for (spec, device) in devices {
            if config.iface_allows(&device.attr().name) {
                push_infos(&mut out, hints, &config, &ep_types, &spec, &device);
            }
        }
    }
    hints.rank(&mut out)?;
    if out.is_empty() {
        return Err(first_err.unwrap_or_else(|| {
            let mut why = hints.describe(&config);
            for n in notes {
                why.push_str("; ");
                why.push_str(n);
            }
            no_data(why)
        }));
    }
    Ok(out)
}

/// Appends the infos of one device: one per endpoint type, unless the domain hint excludes it.
fn push_infos(
    out: &mut Vec<Info>,
    hints: &Hints,
    config: &Config,
    ep_types: &[EpType],
    spec: &DeviceSpec,
    device: &Arc<dyn Device>,
) {
    let attr = device.attr();
    for &t in ep_types {
        let domain = format!("{}{}", attr.name, domain_suffix(t));
        let domain_ok = hints
            .domain
            .as_ref()
            .is_none_or(|want| *want == attr.name || *want == domain);
        if !domain_ok {
            continue;
        }
        let mut info = Info::for_device(spec.kind(), attr, t, config.clone(), spec.clone());
        info.handle = Some(device.clone());
        if hints.mode.contains(Mode::MSG_PREFIX) {
            info = info.with_msg_prefix();
        }
        out.push(info);
    }
}
