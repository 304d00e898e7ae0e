//! Runtime configuration: one [`Config`] field per `FI_EFA_*` parameter of libfabric's EFA
//! provider (the `fi_efa(7)` man page and `prov/efa/src/efa_env.c`), with libfabric's defaults and
//! overrides from the process environment.
//!
//! * [`Config::default()`] is libfabric's default for every parameter.
//! * [`Config::from_env()`] applies the `FI_EFA_*` variables of the real process environment;
//!   [`Config::from_vars()`] does the same from any list of `(name, value)` pairs and never
//!   touches the environment (use it in tests).
//! * Values are parsed the way libfabric parses them, but strictly: integers are decimal or
//!   `0x` hexadecimal, booleans are `1/0`, `true/false`, `yes/no`, `on/off` (case-insensitive),
//!   durations are microseconds (an optional `us`, `ms` or `s` suffix is also accepted). Where
//!   libfabric would silently read garbage as 0 or abort the process, this crate returns an
//!   [`Error`] of kind [`ErrorKind::Config`] whose [`op()`](Error::op) is the variable name.
//! * The deprecated `FI_EFA_MTU_SIZE`, `FI_EFA_TX_IOV_LIMIT` and `FI_EFA_RX_IOV_LIMIT` (libfabric
//!   aborts when they are set) are refused with a `Config` error.
//! * Other `FI_EFA_*` variables this crate does not know are ignored with a `tracing` warning,
//!   as libfabric ignores them. Variables without the `FI_EFA_` prefix are not looked at.
//!
//! The table of all variables, with the device each one affects, is in `docs/config.md`.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Largest `FI_EFA_RECVWIN_SIZE`: every peer gets a reorder window this large, so a larger
/// value would let the number of peers multiply it into memory exhaustion (libfabric's
/// documented maximum default, 16384, fits well below).
pub const MAX_RECVWIN_SIZE: usize = 1 << 16;

/// Every `FI_EFA_*` runtime parameter. `Default` gives libfabric's defaults.
///
/// Serializes with serde (durations as integer microseconds); deserializing fills missing fields
/// with their defaults and refuses unknown fields. A deserialized or hand-built value should be
/// checked with [`Config::validate`] (`getinfo` does).
///
/// `#[non_exhaustive]` (a new `FI_EFA_*` variable is a new field): build it from
/// [`Config::default`] or [`Config::from_env`] with the `with_*` methods, one per field, or assign
/// its public fields (docs/api-conventions.md).
///
/// ```
/// use efa::Config;
/// let c = Config::default().with_tx_size(64).with_use_device_rdma(false);
/// assert_eq!((c.tx_size, c.use_device_rdma), (64, Some(false)));
/// assert!(c.validate().is_ok());
/// ```
///
/// ```compile_fail,E0639
/// let c = efa::Config { tx_size: 64, ..efa::Config::default() };
/// ```
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// `FI_EFA_IFACE` (default `"all"`): comma-separated list of device names that may be used,
    /// or `all`. Names are matched exactly (case-sensitive) against the device name
    /// (`rdmap0s6`, `udp-127.0.0.1`, `loopback0`, ...). Applies to every device kind here, not
    /// only to EFA NICs. Must not be empty.
    pub iface: String,
    /// `FI_EFA_TX_MIN_CREDITS` (default 32): packets of credit a long-CTS sender requests from
    /// the receiver (the CTS window is `credits × (mtu − 32)` bytes). Must be > 0 (0 would
    /// deadlock; libfabric aborts). RDM endpoints.
    pub tx_min_credits: u32,
    /// `FI_EFA_TX_QUEUE_SIZE` (default 0 = the device's send queue depth): cap on the sends
    /// outstanding on the device. RDM endpoints.
    pub tx_queue_size: usize,
    /// `FI_EFA_TX_SIZE` (default 0 = `rounddown_pow2(device max_send_wr)`): `tx_attr.size` of
    /// RDM endpoints; above the device depth, sends are queued by the provider. As in
    /// libfabric, DGRAM endpoints always use the device depth.
    pub tx_size: usize,
    /// `FI_EFA_RX_SIZE` (default 0 = `rounddown_pow2(device max_recv_wr / max_sge)`):
    /// `rx_attr.size` of RDM endpoints. DGRAM endpoints use the device depth.
    pub rx_size: usize,
    /// `FI_EFA_ENABLE_SHM_TRANSFER` (default true): RDM endpoints reach peers on the same host
    /// through the `shm` device. Also lowers the RDM inject size to the shm limit (4096).
    /// Accepts an integer (non-zero = true) as libfabric does, and the boolean spellings.
    pub enable_shm_transfer: bool,
    /// `FI_EFA_USE_ZCPY_RX` (default true): legacy zero-copy receive; today it only decides
    /// whether to handshake before sending to a peer that may use zero-copy receive. Accepts an
    /// integer or a boolean. RDM endpoints.
    pub use_zcpy_rx: bool,
    /// `FI_EFA_SHM_AV_SIZE` (default 256): address-vector size of the shm peer. RDM with shm.
    pub shm_av_size: usize,
    /// `FI_EFA_RECVWIN_SIZE` (default 16): per-peer reorder window, in messages. Must be a power
    /// of two from 1 to [`MAX_RECVWIN_SIZE`]; messages beyond the window go to an overflow
    /// list. (The man page and
    /// libfabric's parameter help still say 16384; the code default has been 16 since v2.5.)
    pub recvwin_size: usize,
    /// `FI_EFA_READCOPY_POOL_SIZE` (default 256): packets in the read-copy pool used to copy
    /// into device (GPU) memory. Without device memory it has no effect.
    pub readcopy_pool_size: usize,
    /// `FI_EFA_CQ_SIZE` (default 8192): entries of a completion queue created without an
    /// explicit size. Must be ≥ 1.
    pub cq_size: usize,
    /// `FI_EFA_MAX_MEMCPY_SIZE` (default 4096): parsed for compatibility only — libfabric has
    /// not read it since January 2023, and neither does this crate.
    pub max_memcpy_size: usize,
    /// `FI_EFA_MR_CACHE_ENABLE` (default true): cache the provider's own registrations of user
    /// buffers (medium/long/read protocols). RDM endpoints.
    pub mr_cache_enable: bool,
    /// `FI_EFA_MR_MAX_CACHED_COUNT` (default 0 = 90 % of the device's registration limit):
    /// most registrations kept in the MR cache.
    pub mr_max_cached_count: usize,
    /// `FI_EFA_MR_MAX_CACHED_SIZE` (default 0 = 90 % of the device's largest registration):
    /// most bytes kept registered by the MR cache.
    pub mr_max_cached_size: usize,
    /// `FI_EFA_RX_COPY_UNEXP` (default true): copy unexpected messages out of the pre-posted
    /// receive packets into a growable pool, so the fixed pool is never exhausted. RDM.
    pub rx_copy_unexp: bool,
    /// `FI_EFA_RX_COPY_OOO` (default true): likewise for out-of-order packets. RDM.
    pub rx_copy_ooo: bool,
    /// `FI_EFA_MAX_TIMEOUT` (default 1 000 000 µs = 1 s): cap of the exponential
    /// receiver-not-ready backoff towards a peer. Read as microseconds; values above
    /// [`Config::MAX_TIMEOUT_CAP`] are clamped when read from the environment (as libfabric does)
    /// and refused by [`Config::validate`] when set in code. RDM endpoints.
    #[serde(with = "micros")]
    pub max_timeout: Duration,
    /// `FI_EFA_TIMEOUT_INTERVAL` (default 0 = random 40–119 µs): first RNR backoff interval,
    /// doubled on each new backoff up to `max_timeout`. Microseconds. RDM endpoints.
    #[serde(with = "micros")]
    pub timeout_interval: Duration,
    /// `FI_EFA_EFA_CQ_READ_SIZE` (default 50): device completions read per progress pass. ≥ 1.
    pub efa_cq_read_size: usize,
    /// `FI_EFA_SHM_CQ_READ_SIZE` (default 50): shm completions read per progress pass. ≥ 1.
    pub shm_cq_read_size: usize,
    /// `FI_EFA_INTER_MAX_MEDIUM_MESSAGE_SIZE` (default 65536): largest message sent with the
    /// medium protocol (several packets, no flow control); larger ones use long-CTS or read.
    pub inter_max_medium_message_size: usize,
    /// `FI_EFA_INTER_MIN_READ_MESSAGE_SIZE` (default 1048576): smallest message sent with the
    /// long-read protocol when both sides have device RDMA read.
    pub inter_min_read_message_size: usize,
    /// `FI_EFA_INTER_MIN_READ_WRITE_SIZE` (default 65536): smallest emulated write that uses the
    /// long-read write protocol when device RDMA read is available (device RDMA write, when
    /// present, is always used instead).
    pub inter_min_read_write_size: usize,
    /// `FI_EFA_INTER_READ_SEGMENT_SIZE` (default 1 GiB): RDMA reads are split into segments of
    /// at most this size (and of the device's `max_rdma_size`). ≥ 1.
    pub inter_read_segment_size: usize,
    /// `FI_EFA_INTER_MAX_GDRCOPY_MESSAGE_SIZE` (default 32768): largest copy into GPU memory done
    /// with gdrcopy. No effect: this crate has no device (GPU) memory support.
    pub inter_max_gdrcopy_message_size: usize,
    /// `FI_EFA_RUNT_SIZE` (default 0 for host memory): bytes sent eagerly ("runt") by a read
    /// message before the receiver RDMA-reads the rest; 0 disables runting read. libfabric's
    /// man page says 307200, which is the CUDA/ROCr default; host memory — the only memory this
    /// crate handles — defaults to 0.
    pub runt_size: usize,
    /// `FI_EFA_USE_DEVICE_RDMA` (default unset = use device RDMA where the device supports it):
    /// `Some(false)` emulates all RMA in software; `Some(true)` on a device without RDMA is a
    /// configuration error (libfabric aborts). See [`Config::device_rdma`].
    pub use_device_rdma: Option<bool>,
    /// `FI_EFA_FORK_SAFE` (default false): make registered memory safe across `fork()` and stop
    /// using huge pages for internal buffers. Only the `efa` device (rdma-core) is affected;
    /// software devices are always fork safe.
    pub fork_safe: bool,
    /// `FI_EFA_USE_HUGE_PAGE` (default unset = yes unless `fork_safe`): huge pages for internal
    /// packet buffers. `Some(true)` together with `fork_safe` is refused (libfabric aborts).
    /// Only the `efa` device is affected; software devices ignore it.
    pub use_huge_page: Option<bool>,
    /// `FI_EFA_USE_SM2` (default false): use libfabric's experimental `sm2` shared-memory
    /// provider instead of `shm`. No effect here (there is no `sm2` device).
    pub use_sm2: bool,
    /// `FI_EFA_USE_UNSOLICITED_WRITE_RECV` (default true): RDMA write with immediate data
    /// completes at the target without consuming a receive buffer, when the device can.
    pub use_unsolicited_write_recv: bool,
    /// `FI_EFA_INTERNAL_RX_REFILL_THRESHOLD` (default 8): internal receive packets are reposted
    /// in bulk once at least this many are free. RDM endpoints.
    pub internal_rx_refill_threshold: usize,
    /// `FI_EFA_USE_DATA_PATH_DIRECT` (default true): write work requests and read completions
    /// directly in the device's mapped queues, bypassing rdma-core. Only the `efa` device;
    /// software devices ignore it.
    pub use_data_path_direct: bool,
    /// `FI_EFA_IMPLICIT_AV_SIZE` (default 0 = unbounded): peers that sent to an RDM endpoint
    /// without being inserted in its address vector are remembered in an "implicit" AV of at
    /// most this many entries (least recently used evicted).
    pub implicit_av_size: usize,
    /// `FI_EFA_TRACK_MR` (default false): warn when a memory region is closed while operations
    /// still reference it.
    pub track_mr: bool,
}

with_setters! {
    Config {
        with_tx_min_credits => tx_min_credits: u32,
        with_tx_queue_size => tx_queue_size: usize,
        with_tx_size => tx_size: usize,
        with_rx_size => rx_size: usize,
        with_enable_shm_transfer => enable_shm_transfer: bool,
        with_use_zcpy_rx => use_zcpy_rx: bool,
        with_shm_av_size => shm_av_size: usize,
        with_recvwin_size => recvwin_size: usize,
        with_readcopy_pool_size => readcopy_pool_size: usize,
        with_cq_size => cq_size: usize,
        with_max_memcpy_size => max_memcpy_size: usize,
        with_mr_cache_enable => mr_cache_enable: bool,
        with_mr_max_cached_count => mr_max_cached_count: usize,
        with_mr_max_cached_size => mr_max_cached_size: usize,
        with_rx_copy_unexp => rx_copy_unexp: bool,
        with_rx_copy_ooo => rx_copy_ooo: bool,
        with_max_timeout => max_timeout: Duration,
        with_timeout_interval => timeout_interval: Duration,
        with_efa_cq_read_size => efa_cq_read_size: usize,
        with_shm_cq_read_size => shm_cq_read_size: usize,
        with_inter_max_medium_message_size => inter_max_medium_message_size: usize,
        with_inter_min_read_message_size => inter_min_read_message_size: usize,
        with_inter_min_read_write_size => inter_min_read_write_size: usize,
        with_inter_read_segment_size => inter_read_segment_size: usize,
        with_inter_max_gdrcopy_message_size => inter_max_gdrcopy_message_size: usize,
        with_runt_size => runt_size: usize,
        with_fork_safe => fork_safe: bool,
        with_use_sm2 => use_sm2: bool,
        with_use_unsolicited_write_recv => use_unsolicited_write_recv: bool,
        with_internal_rx_refill_threshold => internal_rx_refill_threshold: usize,
        with_use_data_path_direct => use_data_path_direct: bool,
        with_implicit_av_size => implicit_av_size: usize,
        with_track_mr => track_mr: bool,
    }
    into {
        with_iface => iface: String,
    }
    some {
        with_use_device_rdma => use_device_rdma: bool,
        with_use_huge_page => use_huge_page: bool,
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            iface: "all".to_string(),
            tx_min_credits: 32,
            tx_queue_size: 0,
            tx_size: 0,
            rx_size: 0,
            enable_shm_transfer: true,
            use_zcpy_rx: true,
            shm_av_size: 256,
            recvwin_size: 16,
            readcopy_pool_size: 256,
            cq_size: 8192,
            max_memcpy_size: 4096,
            mr_cache_enable: true,
            mr_max_cached_count: 0,
            mr_max_cached_size: 0,
            rx_copy_unexp: true,
            rx_copy_ooo: true,
            max_timeout: Duration::from_micros(1_000_000),
            timeout_interval: Duration::ZERO,
            efa_cq_read_size: 50,
            shm_cq_read_size: 50,
            inter_max_medium_message_size: 65536,
            inter_min_read_message_size: 1_048_576,
            inter_min_read_write_size: 65536,
            inter_read_segment_size: 1 << 30,
            inter_max_gdrcopy_message_size: 32768,
            runt_size: 0,
            use_device_rdma: None,
            fork_safe: false,
            use_huge_page: None,
            use_sm2: false,
            use_unsolicited_write_recv: true,
            internal_rx_refill_threshold: 8,
            use_data_path_direct: true,
            implicit_av_size: 0,
            track_mr: false,
        }
    }
}

/// Variables libfabric aborts on; refused here with a `Config` error.
const REFUSED: &[(&str, &str)] = &[
    (
        "FI_EFA_MTU_SIZE",
        "the MTU is the device's and cannot be overridden",
    ),
    (
        "FI_EFA_TX_IOV_LIMIT",
        "the iov limit is the device's (DGRAM) or fixed at 4 (RDM)",
    ),
    (
        "FI_EFA_RX_IOV_LIMIT",
        "the iov limit is the device's (DGRAM) or fixed at 4 (RDM)",
    ),
];

/// Variables that are known but have no effect; ignored with a warning that says why.
const IGNORED: &[(&str, &str)] = &[
    (
        "FI_EFA_SET_CUDA_SYNC_MEMOPS",
        "deprecated in libfabric and has no effect",
    ),
    (
        "FI_EFA_SHM_MAX_MEDIUM_SIZE",
        "deprecated in libfabric and has no effect",
    ),
    (
        "FI_EFA_ZCPY_RX_SEED",
        "deprecated in libfabric and has no effect",
    ),
    (
        "FI_EFA_RX_WINDOW_SIZE",
        "documented by old man pages but read by no current libfabric; no effect",
    ),
    (
        "FI_EFA_USE_HW_CNTR",
        "an unregistered libfabric development switch; no effect in this crate",
    ),
    (
        "FI_EFA_USE_SQ_REQ_ID_64_BIT",
        "an unregistered libfabric development switch; no effect in this crate",
    ),
];

/// One variable: its name, the field it sets, how to parse it and how to print it.
struct Var {
    name: &'static str,
    set: fn(&mut Config, &'static str, &str) -> Result<()>,
    get: fn(&Config) -> Option<String>,
}

macro_rules! var {
    ($name:literal, $field:ident, $parse:ident, $show:ident) => {
        Var {
            name: $name,
            set: |c, n, v| {
                c.$field = $parse(n, v)?;
                Ok(())
            },
            get: |c| $show(&c.$field),
        }
    };
}

/// Every variable, in the order of the fi_efa table (`docs/config.md`).
const VARS: &[Var] = &[
    var!("FI_EFA_IFACE", iface, parse_string, show),
    var!("FI_EFA_TX_MIN_CREDITS", tx_min_credits, parse_u32, show),
    var!("FI_EFA_TX_QUEUE_SIZE", tx_queue_size, parse_usize, show),
    var!("FI_EFA_TX_SIZE", tx_size, parse_usize, show),
    var!("FI_EFA_RX_SIZE", rx_size, parse_usize, show),
    var!(
        "FI_EFA_ENABLE_SHM_TRANSFER",
        enable_shm_transfer,
        parse_int_bool,
        show_bool
    ),
    var!("FI_EFA_USE_ZCPY_RX", use_zcpy_rx, parse_int_bool, show_bool),
    var!("FI_EFA_SHM_AV_SIZE", shm_av_size, parse_usize, show),
    var!("FI_EFA_RECVWIN_SIZE", recvwin_size, parse_usize, show),
    var!(
        "FI_EFA_READCOPY_POOL_SIZE",
        readcopy_pool_size,
        parse_usize,
        show
    ),
    var!("FI_EFA_CQ_SIZE", cq_size, parse_usize, show),
    var!("FI_EFA_MAX_MEMCPY_SIZE", max_memcpy_size, parse_usize, show),
    var!(
        "FI_EFA_MR_CACHE_ENABLE",
        mr_cache_enable,
        parse_bool,
        show_bool
    ),
    var!(
        "FI_EFA_MR_MAX_CACHED_COUNT",
        mr_max_cached_count,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_MR_MAX_CACHED_SIZE",
        mr_max_cached_size,
        parse_usize,
        show
    ),
    var!("FI_EFA_RX_COPY_UNEXP", rx_copy_unexp, parse_bool, show_bool),
    var!("FI_EFA_RX_COPY_OOO", rx_copy_ooo, parse_bool, show_bool),
    var!(
        "FI_EFA_MAX_TIMEOUT",
        max_timeout,
        parse_max_timeout,
        show_micros
    ),
    var!(
        "FI_EFA_TIMEOUT_INTERVAL",
        timeout_interval,
        parse_micros,
        show_micros
    ),
    var!(
        "FI_EFA_EFA_CQ_READ_SIZE",
        efa_cq_read_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_SHM_CQ_READ_SIZE",
        shm_cq_read_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_INTER_MAX_MEDIUM_MESSAGE_SIZE",
        inter_max_medium_message_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_INTER_MIN_READ_MESSAGE_SIZE",
        inter_min_read_message_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_INTER_MIN_READ_WRITE_SIZE",
        inter_min_read_write_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_INTER_READ_SEGMENT_SIZE",
        inter_read_segment_size,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_INTER_MAX_GDRCOPY_MESSAGE_SIZE",
        inter_max_gdrcopy_message_size,
        parse_usize,
        show
    ),
    var!("FI_EFA_RUNT_SIZE", runt_size, parse_usize, show),
    var!(
        "FI_EFA_USE_DEVICE_RDMA",
        use_device_rdma,
        parse_opt_bool,
        show_opt_bool
    ),
    var!("FI_EFA_FORK_SAFE", fork_safe, parse_bool, show_bool),
    var!(
        "FI_EFA_USE_HUGE_PAGE",
        use_huge_page,
        parse_opt_bool,
        show_opt_bool
    ),
    var!("FI_EFA_USE_SM2", use_sm2, parse_bool, show_bool),
    var!(
        "FI_EFA_USE_UNSOLICITED_WRITE_RECV",
        use_unsolicited_write_recv,
        parse_bool,
        show_bool
    ),
    var!(
        "FI_EFA_INTERNAL_RX_REFILL_THRESHOLD",
        internal_rx_refill_threshold,
        parse_usize,
        show
    ),
    var!(
        "FI_EFA_USE_DATA_PATH_DIRECT",
        use_data_path_direct,
        parse_bool,
        show_bool
    ),
    var!(
        "FI_EFA_IMPLICIT_AV_SIZE",
        implicit_av_size,
        parse_usize,
        show
    ),
    var!("FI_EFA_TRACK_MR", track_mr, parse_bool, show_bool),
];

/// Warns about an unknown `FI_EFA_*` variable, once per name in the process (a configuration is
/// read for every domain and device), naming the known variable it most likely meant.
fn warn_unknown(name: &str) {
    static SAID: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());
    {
        let mut said = SAID.lock();
        if said.iter().any(|n| n == name) {
            return;
        }
        said.push(name.to_string());
    }
    match meant(name) {
        Some(known) => tracing::warn!(
            variable = name,
            "unknown FI_EFA_* environment variable ignored; did you mean {known}?"
        ),
        None => tracing::warn!(
            variable = name,
            "unknown FI_EFA_* environment variable ignored"
        ),
    }
}

/// The known variable `name` most likely misspells: the same but for underscores or case, or
/// at most two letters off.
fn meant(name: &str) -> Option<&'static str> {
    let squash = |s: &str| s.replace('_', "").to_ascii_uppercase();
    let want = squash(name);
    let known = VARS.iter().map(|v| v.name);
    if let Some(k) = known.clone().find(|k| squash(k) == want) {
        return Some(k);
    }
    known
        .map(|k| (edit_distance(&squash(k), &want), k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance of two short ASCII strings.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

impl Config {
    /// The largest accepted [`max_timeout`](Config::max_timeout): `INT_MAX / 2 − 1` µs
    /// (about 17.9 minutes), libfabric's cap, so that doubling the backoff never overflows.
    pub const MAX_TIMEOUT_CAP: Duration = Duration::from_micros((i32::MAX / 2 - 1) as u64);

    /// libfabric's defaults overridden by the `FI_EFA_*` variables of the process environment.
    ///
    /// Equivalent to [`Config::from_vars`]`(std::env::vars_os())`; a `FI_EFA_*` variable whose
    /// value is not valid UTF-8 is a `Config` error.
    pub fn from_env() -> Result<Config> {
        let mut vars = Vec::new();
        for (k, v) in std::env::vars_os() {
            let Some(k) = k.to_str() else { continue };
            if !k.starts_with("FI_EFA_") {
                continue;
            }
            match (v.into_string(), known_name(k)) {
                (Ok(v), _) => vars.push((k.to_string(), v)),
                (Err(_), Some(name)) => {
                    return Err(config_error(
                        name,
                        "the value is not valid UTF-8; expected text",
                    ));
                }
                // Not valid UTF-8 and unknown: said by `from_vars`' warning would need the value;
                // say it here, once.
                (Err(_), None) => warn_unknown(k),
            }
        }
        Config::from_vars(vars)
    }

    /// libfabric's defaults overridden by the `FI_EFA_*` entries of `vars` (other names are
    /// skipped); pure, it never reads the process environment. When a name appears twice the
    /// last value wins. The result is [validated](Config::validate).
    ///
    /// ```
    /// use std::time::Duration;
    /// use efa::{Config, ErrorKind};
    ///
    /// let c = Config::from_vars([
    ///     ("FI_EFA_RECVWIN_SIZE", "64"),
    ///     ("FI_EFA_RX_COPY_OOO", "off"),
    ///     ("FI_EFA_MAX_TIMEOUT", "2000"), // microseconds
    ///     ("HOME", "/root"),              // not FI_EFA_*: skipped
    /// ])?;
    /// assert_eq!(c.recvwin_size, 64);
    /// assert!(!c.rx_copy_ooo);
    /// assert_eq!(c.max_timeout, Duration::from_millis(2));
    /// assert_eq!(c.cq_size, Config::default().cq_size);
    ///
    /// let err = Config::from_vars([("FI_EFA_RECVWIN_SIZE", "12")]).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::Config);
    /// assert_eq!(err.op(), "FI_EFA_RECVWIN_SIZE");
    /// # Ok::<(), efa::Error>(())
    /// ```
    pub fn from_vars<I, K, V>(vars: I) -> Result<Config>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut c = Config::default();
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref());
            if !k.starts_with("FI_EFA_") {
                continue;
            }
            if let Some(var) = VARS.iter().find(|var| var.name == k) {
                (var.set)(&mut c, var.name, v)?;
            } else if let Some((name, why)) = REFUSED.iter().find(|(n, _)| *n == k) {
                return Err(config_error(
                    name,
                    format!(
                        "{name} is no longer supported ({why}); libfabric aborts when it is set. \
                         Unset it"
                    ),
                ));
            } else if let Some((name, why)) = IGNORED.iter().find(|(n, _)| *n == k) {
                tracing::warn!(variable = name, value = v, "{name} is {why}; ignored");
            } else {
                warn_unknown(k);
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the rules the environment parser enforces, for a configuration built in code or
    /// deserialized. The error's [`op()`](Error::op) names the offending variable.
    ///
    /// ```
    /// use efa::Config;
    /// let mut c = Config::default();
    /// c.recvwin_size = 100;
    /// assert_eq!(c.validate().unwrap_err().op(), "FI_EFA_RECVWIN_SIZE");
    /// ```
    pub fn validate(&self) -> Result<()> {
        if self.iface.trim().is_empty() {
            return Err(config_error(
                "FI_EFA_IFACE",
                "must not be empty; expected comma-separated device names or \"all\"",
            ));
        }
        if self.tx_min_credits == 0 {
            return Err(config_error(
                "FI_EFA_TX_MIN_CREDITS",
                "must be > 0 (0 credits would deadlock long-CTS transfers), got 0",
            ));
        }
        if !self.recvwin_size.is_power_of_two() || self.recvwin_size > MAX_RECVWIN_SIZE {
            return Err(config_error(
                "FI_EFA_RECVWIN_SIZE",
                format!(
                    "must be a power of two between 1 and {MAX_RECVWIN_SIZE} (each peer holds a \
                     window this large), got {}",
                    self.recvwin_size
                ),
            ));
        }
        for (name, v) in [
            ("FI_EFA_CQ_SIZE", self.cq_size),
            ("FI_EFA_EFA_CQ_READ_SIZE", self.efa_cq_read_size),
            ("FI_EFA_SHM_CQ_READ_SIZE", self.shm_cq_read_size),
            (
                "FI_EFA_INTER_READ_SEGMENT_SIZE",
                self.inter_read_segment_size,
            ),
        ] {
            if v == 0 {
                return Err(config_error(name, "must be >= 1, got 0"));
            }
        }
        if self.max_timeout > Config::MAX_TIMEOUT_CAP {
            return Err(config_error(
                "FI_EFA_MAX_TIMEOUT",
                format!(
                    "must be at most {} us, got {} us",
                    Config::MAX_TIMEOUT_CAP.as_micros(),
                    self.max_timeout.as_micros()
                ),
            ));
        }
        if self.timeout_interval > Config::MAX_TIMEOUT_CAP {
            return Err(config_error(
                "FI_EFA_TIMEOUT_INTERVAL",
                format!(
                    "must be at most {} us, got {} us",
                    Config::MAX_TIMEOUT_CAP.as_micros(),
                    self.timeout_interval.as_micros()
                ),
            ));
        }
        if self.fork_safe && self.use_huge_page == Some(true) {
            return Err(config_error(
                "FI_EFA_USE_HUGE_PAGE",
                "cannot be 1 together with FI_EFA_FORK_SAFE=1 (huge pages are not fork safe; \
                 libfabric aborts); unset one of them",
            ));
        }
        Ok(())
    }

    /// Every variable with its value, as `from_vars` reads them: `from_vars(c.to_env_vars())`
    /// gives `c` back. Unset optional variables (`use_device_rdma`, `use_huge_page` = `None`)
    /// are left out. Durations are printed in microseconds, booleans as `1`/`0`.
    ///
    /// ```
    /// use efa::Config;
    /// let c = Config::default().with_recvwin_size(256);
    /// assert!(c.to_env_vars().contains(&("FI_EFA_RECVWIN_SIZE".into(), "256".into())));
    /// assert_eq!(Config::from_vars(c.to_env_vars()).unwrap(), c);
    /// ```
    pub fn to_env_vars(&self) -> Vec<(String, String)> {
        VARS.iter()
            .filter_map(|v| (v.get)(self).map(|val| (v.name.to_string(), val)))
            .collect()
    }

    /// The names of all variables this crate reads, in the order of `docs/config.md`.
    pub fn env_var_names() -> impl Iterator<Item = &'static str> {
        VARS.iter().map(|v| v.name)
    }

    /// Whether `FI_EFA_IFACE` lets the device called `name` be used: `all`, or `name` is one of
    /// the comma-separated entries (surrounding spaces ignored, case-sensitive).
    ///
    /// ```
    /// use efa::Config;
    /// let c = Config::default().with_iface("rdmap0s6, udp-127.0.0.1");
    /// assert!(c.iface_allows("udp-127.0.0.1"));
    /// assert!(!c.iface_allows("loopback0"));
    /// assert!(Config::default().iface_allows("anything"));
    /// ```
    pub fn iface_allows(&self, name: &str) -> bool {
        let list = self.iface.trim();
        list == "all" || list.split(',').any(|n| n.trim() == name)
    }

    /// Whether to use the device's RDMA (read, and write where the device also has it):
    /// `FI_EFA_USE_DEVICE_RDMA` if set, else whether the device has RDMA read. Asking for it on
    /// a device without RDMA read is a `Config` error (libfabric aborts the process); as in
    /// libfabric, RDMA read is the capability that decides.
    pub fn device_rdma(&self, rdma_read: bool) -> Result<bool> {
        let supported = rdma_read;
        match self.use_device_rdma {
            None => Ok(supported),
            Some(false) => Ok(false),
            Some(true) if supported => Ok(true),
            Some(true) => Err(config_error(
                "FI_EFA_USE_DEVICE_RDMA",
                "is 1 but the device has no RDMA read; unset it or set it to 0",
            )),
        }
    }

    /// Whether internal buffers may use huge pages: `FI_EFA_USE_HUGE_PAGE` if set, else
    /// `!fork_safe`. (Only the `efa` device uses huge pages.)
    pub fn huge_pages(&self) -> bool {
        self.use_huge_page.unwrap_or(!self.fork_safe)
    }
}

impl fmt::Display for Config {
    /// One `NAME=value` per line, as [`Config::to_env_vars`] gives them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, v) in self.to_env_vars() {
            writeln!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

fn config_error(name: &'static str, detail: impl Into<String>) -> Error {
    Error::new(ErrorKind::Config, name).with_detail(detail)
}

/// The `'static` name of a variable that is read or refused (not of an ignored one).
fn known_name(k: &str) -> Option<&'static str> {
    VARS.iter()
        .map(|v| v.name)
        .chain(REFUSED.iter().map(|r| r.0))
        .find(|n| *n == k)
}

fn show<T: fmt::Display>(v: &T) -> Option<String> {
    Some(v.to_string())
}

fn show_bool(v: &bool) -> Option<String> {
    Some(if *v { "1" } else { "0" }.to_string())
}

fn show_opt_bool(v: &Option<bool>) -> Option<String> {
    v.as_ref().and_then(show_bool)
}

fn show_micros(v: &Duration) -> Option<String> {
    Some(v.as_micros().to_string())
}

fn parse_string(_name: &'static str, v: &str) -> Result<String> {
    // Emptiness is checked by `validate` (the same rule for code-built configs).
    Ok(v.trim().to_string())
}

fn bool_word(v: &str) -> Option<bool> {
    let v = v.trim();
    const TRUE: [&str; 4] = ["1", "true", "yes", "on"];
    const FALSE: [&str; 4] = ["0", "false", "no", "off"];
    if TRUE.iter().any(|t| v.eq_ignore_ascii_case(t)) {
        Some(true)
    } else if FALSE.iter().any(|t| v.eq_ignore_ascii_case(t)) {
        Some(false)
    } else {
        None
    }
}

fn parse_bool(name: &'static str, v: &str) -> Result<bool> {
    bool_word(v).ok_or_else(|| {
        config_error(
            name,
            format!(
                "expected a boolean: 1/0, true/false, yes/no or on/off (case-insensitive), \
                 got {v:?}"
            ),
        )
    })
}

fn parse_opt_bool(name: &'static str, v: &str) -> Result<Option<bool>> {
    parse_bool(name, v).map(Some)
}

/// libfabric reads these as integers (`0` off, anything else on); the boolean words are also
/// accepted.
fn parse_int_bool(name: &'static str, v: &str) -> Result<bool> {
    if let Some(b) = bool_word(v) {
        return Ok(b);
    }
    parse_u64_raw(v).map(|n| n != 0).ok_or_else(|| {
        config_error(
            name,
            format!(
                "expected an integer (0 = off) or a boolean (1/0, true/false, yes/no, on/off), \
                 got {v:?}"
            ),
        )
    })
}

/// Decimal or `0x` hexadecimal, optional leading `+`, surrounding spaces ignored.
fn parse_u64_raw(v: &str) -> Option<u64> {
    let v = v.trim();
    let v = v.strip_prefix('+').unwrap_or(v);
    if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    } else {
        if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        v.parse().ok()
    }
}

fn parse_unsigned(name: &'static str, v: &str, max: u64) -> Result<u64> {
    let Some(n) = parse_u64_raw(v) else {
        let t = v.trim();
        let digits = !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        return Err(config_error(
            name,
            if digits {
                format!("{v:?} is out of range (at most {max})")
            } else {
                format!("expected a non-negative integer (decimal or 0x hex), got {v:?}")
            },
        ));
    };
    if n > max {
        return Err(config_error(
            name,
            format!("{v:?} is out of range (at most {max})"),
        ));
    }
    Ok(n)
}

fn parse_usize(name: &'static str, v: &str) -> Result<usize> {
    // `usize` is at most 64 bits on every supported target.
    parse_unsigned(name, v, usize::MAX as u64).map(|n| n as usize)
}

fn parse_u32(name: &'static str, v: &str) -> Result<u32> {
    parse_unsigned(name, v, u32::MAX.into()).map(|n| n as u32)
}

/// Microseconds, optionally with a `us`/`µs`, `ms` or `s` suffix.
fn parse_micros(name: &'static str, v: &str) -> Result<Duration> {
    let t = v.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("us").or_else(|| t.strip_suffix("µs")) {
        (n, 1)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1_000)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1_000_000)
    } else {
        (t, 1)
    };
    parse_u64_raw(num)
        .and_then(|n| n.checked_mul(scale))
        .map(Duration::from_micros)
        .ok_or_else(|| {
            config_error(
                name,
                format!(
                    "expected a non-negative whole number of microseconds (optionally with a \
                     us, ms or s suffix), got {v:?}"
                ),
            )
        })
}

/// As libfabric: values above the cap are clamped (with a warning), not refused.
fn parse_max_timeout(name: &'static str, v: &str) -> Result<Duration> {
    let d = parse_micros(name, v)?;
    if d > Config::MAX_TIMEOUT_CAP {
        tracing::warn!(
            variable = name,
            value = v,
            cap_us = Config::MAX_TIMEOUT_CAP.as_micros() as u64,
            "FI_EFA_MAX_TIMEOUT above the cap; clamped"
        );
        return Ok(Config::MAX_TIMEOUT_CAP);
    }
    Ok(d)
}

/// `Duration` as an integer number of microseconds.
mod micros {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

#[cfg(test)]
mod tests {
    /// A misspelt variable is named with the one it most likely meant (issue 28: the
    /// `FI_EFA_TXSIZE` warning named nothing).
    #[test]
    fn a_typo_names_the_variable_meant() {
        use super::meant;
        assert_eq!(meant("FI_EFA_TXSIZE"), Some("FI_EFA_TX_SIZE"));
        assert_eq!(meant("FI_EFA_RECVWIN_SIZ"), Some("FI_EFA_RECVWIN_SIZE"));
        assert_eq!(meant("fi_efa_cq_size"), Some("FI_EFA_CQ_SIZE"));
        assert_eq!(meant("FI_EFA_SOMETHING_ELSE_ENTIRELY"), None);
    }
}
