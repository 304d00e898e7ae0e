//! `Config`: libfabric's defaults, `FI_EFA_*` overrides, validation, serde.
//!
//! Every test goes through `Config::from_vars`, never through the real process environment.

use std::time::Duration;

use efa::{Config, ErrorKind};

/// The variables of fi_efa(7) / efa_env.c this crate reads, in `docs/config.md` order.
const ALL_VARS: &[&str] = &[
    "FI_EFA_IFACE",
    "FI_EFA_TX_MIN_CREDITS",
    "FI_EFA_TX_QUEUE_SIZE",
    "FI_EFA_TX_SIZE",
    "FI_EFA_RX_SIZE",
    "FI_EFA_ENABLE_SHM_TRANSFER",
    "FI_EFA_USE_ZCPY_RX",
    "FI_EFA_SHM_AV_SIZE",
    "FI_EFA_RECVWIN_SIZE",
    "FI_EFA_READCOPY_POOL_SIZE",
    "FI_EFA_CQ_SIZE",
    "FI_EFA_MAX_MEMCPY_SIZE",
    "FI_EFA_MR_CACHE_ENABLE",
    "FI_EFA_MR_MAX_CACHED_COUNT",
    "FI_EFA_MR_MAX_CACHED_SIZE",
    "FI_EFA_RX_COPY_UNEXP",
    "FI_EFA_RX_COPY_OOO",
    "FI_EFA_MAX_TIMEOUT",
    "FI_EFA_TIMEOUT_INTERVAL",
    "FI_EFA_EFA_CQ_READ_SIZE",
    "FI_EFA_SHM_CQ_READ_SIZE",
    "FI_EFA_INTER_MAX_MEDIUM_MESSAGE_SIZE",
    "FI_EFA_INTER_MIN_READ_MESSAGE_SIZE",
    "FI_EFA_INTER_MIN_READ_WRITE_SIZE",
    "FI_EFA_INTER_READ_SEGMENT_SIZE",
    "FI_EFA_INTER_MAX_GDRCOPY_MESSAGE_SIZE",
    "FI_EFA_RUNT_SIZE",
    "FI_EFA_USE_DEVICE_RDMA",
    "FI_EFA_FORK_SAFE",
    "FI_EFA_USE_HUGE_PAGE",
    "FI_EFA_USE_SM2",
    "FI_EFA_USE_UNSOLICITED_WRITE_RECV",
    "FI_EFA_INTERNAL_RX_REFILL_THRESHOLD",
    "FI_EFA_USE_DATA_PATH_DIRECT",
    "FI_EFA_IMPLICIT_AV_SIZE",
    "FI_EFA_TRACK_MR",
];

fn cfg(vars: &[(&str, &str)]) -> Config {
    Config::from_vars(vars.iter().copied()).unwrap_or_else(|e| panic!("{vars:?}: {e}"))
}

fn err(vars: &[(&str, &str)]) -> efa::Error {
    match Config::from_vars(vars.iter().copied()) {
        Ok(c) => panic!("{vars:?} was accepted: {c:?}"),
        Err(e) => e,
    }
}

#[track_caller]
fn assert_config_err(vars: &[(&str, &str)], op: &str, detail_has: &[&str]) {
    let e = err(vars);
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert_eq!(e.op(), op, "{e}");
    let detail = e.detail().unwrap_or_default();
    for part in detail_has {
        assert!(detail.contains(part), "{detail:?} lacks {part:?}");
    }
    // The message names the variable.
    assert!(e.to_string().starts_with(op), "{e}");
}

#[test]
fn defaults_are_libfabrics() {
    let c = Config::default();
    assert_eq!(c.iface, "all");
    assert_eq!(c.tx_min_credits, 32);
    assert_eq!(c.tx_queue_size, 0);
    assert_eq!(c.tx_size, 0);
    assert_eq!(c.rx_size, 0);
    assert!(c.enable_shm_transfer);
    assert!(c.use_zcpy_rx);
    assert_eq!(c.shm_av_size, 256);
    assert_eq!(c.recvwin_size, 16);
    assert_eq!(c.readcopy_pool_size, 256);
    assert_eq!(c.cq_size, 8192);
    assert_eq!(c.max_memcpy_size, 4096);
    assert!(c.mr_cache_enable);
    assert_eq!(c.mr_max_cached_count, 0);
    assert_eq!(c.mr_max_cached_size, 0);
    assert!(c.rx_copy_unexp);
    assert!(c.rx_copy_ooo);
    assert_eq!(c.max_timeout, Duration::from_micros(1_000_000));
    assert_eq!(c.timeout_interval, Duration::ZERO);
    assert_eq!(c.efa_cq_read_size, 50);
    assert_eq!(c.shm_cq_read_size, 50);
    assert_eq!(c.inter_max_medium_message_size, 65536);
    assert_eq!(c.inter_min_read_message_size, 1_048_576);
    assert_eq!(c.inter_min_read_write_size, 65536);
    assert_eq!(c.inter_read_segment_size, 1 << 30);
    assert_eq!(c.inter_max_gdrcopy_message_size, 32768);
    assert_eq!(c.runt_size, 0);
    assert_eq!(c.use_device_rdma, None);
    assert!(!c.fork_safe);
    assert_eq!(c.use_huge_page, None);
    assert!(!c.use_sm2);
    assert!(c.use_unsolicited_write_recv);
    assert_eq!(c.internal_rx_refill_threshold, 8);
    assert!(c.use_data_path_direct);
    assert_eq!(c.implicit_av_size, 0);
    assert!(!c.track_mr);
    c.validate().unwrap();
    assert!(c.huge_pages());
}

#[test]
fn no_variables_give_the_defaults() {
    let none: [(&str, &str); 0] = [];
    assert_eq!(Config::from_vars(none).unwrap(), Config::default());
}

#[test]
fn variable_list_is_complete() {
    let names: Vec<&str> = Config::env_var_names().collect();
    assert_eq!(names, ALL_VARS);
}

/// A configuration in which every field differs from its default.
fn all_changed() -> Config {
    Config::default()
        .with_iface("rdmap0s6,udp-127.0.0.1")
        .with_tx_min_credits(7)
        .with_tx_queue_size(100)
        .with_tx_size(64)
        .with_rx_size(43)
        .with_enable_shm_transfer(false)
        .with_use_zcpy_rx(false)
        .with_shm_av_size(128)
        .with_recvwin_size(1)
        .with_readcopy_pool_size(17)
        .with_cq_size(99)
        .with_max_memcpy_size(1)
        .with_mr_cache_enable(false)
        .with_mr_max_cached_count(5)
        .with_mr_max_cached_size(6)
        .with_rx_copy_unexp(false)
        .with_rx_copy_ooo(false)
        .with_max_timeout(Duration::from_micros(123))
        .with_timeout_interval(Duration::from_micros(45))
        .with_efa_cq_read_size(3)
        .with_shm_cq_read_size(4)
        .with_inter_max_medium_message_size(11)
        .with_inter_min_read_message_size(12)
        .with_inter_min_read_write_size(13)
        .with_inter_read_segment_size(14)
        .with_inter_max_gdrcopy_message_size(15)
        .with_runt_size(65536)
        .with_use_device_rdma(false)
        .with_fork_safe(true)
        .with_use_huge_page(false)
        .with_use_sm2(true)
        .with_use_unsolicited_write_recv(false)
        .with_internal_rx_refill_threshold(9)
        .with_use_data_path_direct(false)
        .with_implicit_av_size(3)
        .with_track_mr(true)
}

#[test]
fn every_variable_overrides_its_own_field() {
    let changed = all_changed();
    changed.validate().unwrap();
    let vars = changed.to_env_vars();
    assert_eq!(
        vars.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ALL_VARS
    );
    let defaults = Config::default().to_env_vars();
    for (k, v) in &vars {
        let c = Config::from_vars([(k, v)]).unwrap();
        let got = c.to_env_vars();
        // Exactly this variable changed, to this value.
        for (gk, gv) in &got {
            if gk == k {
                assert_eq!(gv, v, "{k}");
            } else if let Some((_, dv)) = defaults.iter().find(|(dk, _)| dk == gk) {
                assert_eq!(gv, dv, "setting {k} changed {gk}");
            } else {
                panic!("setting {k} set {gk}");
            }
        }
        assert_ne!(c, Config::default(), "{k}={v} changed nothing");
    }
    assert_eq!(Config::from_vars(vars).unwrap(), changed);
}

#[test]
fn named_overrides() {
    let c = cfg(&[
        ("FI_EFA_IFACE", "rdmap0s6"),
        ("FI_EFA_TX_SIZE", "64"),
        ("FI_EFA_RX_SIZE", "0x40"),
        ("FI_EFA_RECVWIN_SIZE", "1"),
        ("FI_EFA_MAX_TIMEOUT", "250"),
        ("FI_EFA_TIMEOUT_INTERVAL", "3ms"),
        ("FI_EFA_USE_DEVICE_RDMA", "no"),
        ("FI_EFA_USE_HUGE_PAGE", "OFF"),
        ("FI_EFA_FORK_SAFE", "Yes"),
        ("FI_EFA_RUNT_SIZE", "307200"),
        ("FI_EFA_IMPLICIT_AV_SIZE", "3"),
    ]);
    assert_eq!(c.iface, "rdmap0s6");
    assert_eq!(c.tx_size, 64);
    assert_eq!(c.rx_size, 64);
    assert_eq!(c.recvwin_size, 1);
    assert_eq!(c.max_timeout, Duration::from_micros(250));
    assert_eq!(c.timeout_interval, Duration::from_millis(3));
    assert_eq!(c.use_device_rdma, Some(false));
    assert_eq!(c.use_huge_page, Some(false));
    assert!(c.fork_safe);
    assert!(!c.huge_pages());
    assert_eq!(c.runt_size, 307200);
    assert_eq!(c.implicit_av_size, 3);
}

#[test]
fn last_value_wins() {
    let c = cfg(&[("FI_EFA_CQ_SIZE", "10"), ("FI_EFA_CQ_SIZE", "20")]);
    assert_eq!(c.cq_size, 20);
}

#[test]
fn boolean_spellings() {
    for (v, want) in [
        ("1", true),
        ("0", false),
        ("true", true),
        ("FALSE", false),
        ("yes", true),
        ("No", false),
        ("on", true),
        ("oFF", false),
        (" true ", true),
    ] {
        assert_eq!(cfg(&[("FI_EFA_TRACK_MR", v)]).track_mr, want, "{v:?}");
        assert_eq!(
            cfg(&[("FI_EFA_USE_DEVICE_RDMA", v)]).use_device_rdma,
            Some(want),
            "{v:?}"
        );
    }
}

#[test]
fn integer_booleans_accept_integers_too() {
    // libfabric reads FI_EFA_ENABLE_SHM_TRANSFER / FI_EFA_USE_ZCPY_RX as integers.
    assert!(!cfg(&[("FI_EFA_ENABLE_SHM_TRANSFER", "0")]).enable_shm_transfer);
    assert!(cfg(&[("FI_EFA_ENABLE_SHM_TRANSFER", "2")]).enable_shm_transfer);
    assert!(!cfg(&[("FI_EFA_USE_ZCPY_RX", "off")]).use_zcpy_rx);
    assert_config_err(
        &[("FI_EFA_USE_ZCPY_RX", "maybe")],
        "FI_EFA_USE_ZCPY_RX",
        &["integer", "boolean", "maybe"],
    );
}

#[test]
fn invalid_boolean() {
    for v in ["maybe", "", "2", "tru", "-1"] {
        assert_config_err(
            &[("FI_EFA_RX_COPY_OOO", v)],
            "FI_EFA_RX_COPY_OOO",
            &["boolean", "on/off"],
        );
        assert_config_err(
            &[("FI_EFA_USE_HUGE_PAGE", v)],
            "FI_EFA_USE_HUGE_PAGE",
            &["boolean"],
        );
    }
}

#[test]
fn invalid_size() {
    assert_config_err(
        &[("FI_EFA_TX_SIZE", "99999999999999999999999")],
        "FI_EFA_TX_SIZE",
        &["out of range"],
    );
    for v in ["-1", "12abc", "", "1.5", "0x", "ten"] {
        assert_config_err(
            &[("FI_EFA_TX_SIZE", v)],
            "FI_EFA_TX_SIZE",
            &["non-negative integer"],
        );
    }
    // u32 field: in range for u64 but not for u32.
    assert_config_err(
        &[("FI_EFA_TX_MIN_CREDITS", "4294967296")],
        "FI_EFA_TX_MIN_CREDITS",
        &["out of range"],
    );
}

#[test]
fn invalid_power_of_two() {
    for v in ["0", "12", "100", "3"] {
        assert_config_err(
            &[("FI_EFA_RECVWIN_SIZE", v)],
            "FI_EFA_RECVWIN_SIZE",
            &["power of two", v],
        );
    }
    for v in ["1", "2", "16", "16384", "0x4000", "65536"] {
        cfg(&[("FI_EFA_RECVWIN_SIZE", v)]);
    }
}

/// Issue 17, defect 7: a huge reorder window (every peer gets one) is refused with a clear
/// error instead of exhausting memory.
#[test]
fn recvwin_size_has_an_upper_bound() {
    for v in ["131072", "1073741824", "9223372036854775808"] {
        assert_config_err(
            &[("FI_EFA_RECVWIN_SIZE", v)],
            "FI_EFA_RECVWIN_SIZE",
            &["between 1 and 65536", v],
        );
    }
}

#[test]
fn invalid_duration() {
    for v in ["-3", "1.5s", "soon", "10min", ""] {
        assert_config_err(
            &[("FI_EFA_MAX_TIMEOUT", v)],
            "FI_EFA_MAX_TIMEOUT",
            &["microseconds"],
        );
        assert_config_err(
            &[("FI_EFA_TIMEOUT_INTERVAL", v)],
            "FI_EFA_TIMEOUT_INTERVAL",
            &["microseconds"],
        );
    }
    assert_eq!(
        cfg(&[("FI_EFA_MAX_TIMEOUT", "2s")]).max_timeout,
        Duration::from_secs(2)
    );
    assert_eq!(
        cfg(&[("FI_EFA_MAX_TIMEOUT", "7us")]).max_timeout,
        Duration::from_micros(7)
    );
}

#[test]
fn max_timeout_is_clamped_like_libfabric() {
    let c = cfg(&[("FI_EFA_MAX_TIMEOUT", "4000000000")]);
    assert_eq!(c.max_timeout, Config::MAX_TIMEOUT_CAP);
    assert_eq!(
        Config::MAX_TIMEOUT_CAP.as_micros(),
        (i32::MAX / 2 - 1) as u128
    );
    // Built in code, the same value is refused.
    let c = Config::default().with_max_timeout(Duration::from_secs(4000));
    assert_eq!(c.validate().unwrap_err().op(), "FI_EFA_MAX_TIMEOUT");
}

#[test]
fn semantic_rules() {
    assert_config_err(
        &[("FI_EFA_TX_MIN_CREDITS", "0")],
        "FI_EFA_TX_MIN_CREDITS",
        &["> 0"],
    );
    assert_config_err(&[("FI_EFA_IFACE", "")], "FI_EFA_IFACE", &["empty"]);
    assert_config_err(&[("FI_EFA_IFACE", "  ")], "FI_EFA_IFACE", &["empty"]);
    for name in [
        "FI_EFA_CQ_SIZE",
        "FI_EFA_EFA_CQ_READ_SIZE",
        "FI_EFA_SHM_CQ_READ_SIZE",
        "FI_EFA_INTER_READ_SEGMENT_SIZE",
    ] {
        assert_config_err(&[(name, "0")], name, &[">= 1"]);
    }
    assert_config_err(
        &[("FI_EFA_FORK_SAFE", "1"), ("FI_EFA_USE_HUGE_PAGE", "1")],
        "FI_EFA_USE_HUGE_PAGE",
        &["FI_EFA_FORK_SAFE"],
    );
    // Fork safe alone turns huge pages off; explicit 0 with fork safe is fine.
    assert!(!cfg(&[("FI_EFA_FORK_SAFE", "1")]).huge_pages());
    cfg(&[("FI_EFA_FORK_SAFE", "1"), ("FI_EFA_USE_HUGE_PAGE", "0")]);
}

#[test]
fn validate_applies_the_same_rules_in_code() {
    let base = Config::default();
    let cases: Vec<(Config, &str)> = vec![
        (base.clone().with_recvwin_size(0), "FI_EFA_RECVWIN_SIZE"),
        (base.clone().with_recvwin_size(24), "FI_EFA_RECVWIN_SIZE"),
        (base.clone().with_tx_min_credits(0), "FI_EFA_TX_MIN_CREDITS"),
        (base.clone().with_iface(String::new()), "FI_EFA_IFACE"),
        (base.clone().with_cq_size(0), "FI_EFA_CQ_SIZE"),
        (
            base.clone().with_fork_safe(true).with_use_huge_page(true),
            "FI_EFA_USE_HUGE_PAGE",
        ),
    ];
    for (c, op) in cases {
        let e = c.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.op(), op);
    }
}

#[test]
fn deprecated_variables_are_refused() {
    for name in [
        "FI_EFA_MTU_SIZE",
        "FI_EFA_TX_IOV_LIMIT",
        "FI_EFA_RX_IOV_LIMIT",
    ] {
        // Any value, even an empty one, is refused: libfabric aborts when the variable is set.
        for v in ["8192", ""] {
            assert_config_err(&[(name, v)], name, &["no longer supported", "Unset"]);
        }
    }
}

#[test]
fn unknown_and_ignored_variables_are_skipped() {
    let c = cfg(&[
        ("FI_EFA_NO_SUCH_THING", "1"),
        ("FI_EFA_SHM_MAX_MEDIUM_SIZE", "4096"),
        ("FI_EFA_SET_CUDA_SYNC_MEMOPS", "0"),
        ("FI_EFA_ZCPY_RX_SEED", "5"),
        ("FI_EFA_USE_HW_CNTR", "0"),
        ("FI_PROVIDER", "efa"),
        ("fi_efa_tx_size", "garbage"),
        ("PATH", "/usr/bin"),
    ]);
    assert_eq!(c, Config::default());
}

#[test]
fn from_env_reads_the_process_environment() {
    // Whatever the environment holds, from_env is from_vars over it.
    let expect = Config::from_vars(std::env::vars());
    let got = Config::from_env();
    match (got, expect) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!((a.kind(), a.op()), (b.kind(), b.op())),
        (a, b) => panic!("from_env {a:?} vs from_vars(env) {b:?}"),
    }
}

#[test]
fn iface_list() {
    let c = cfg(&[("FI_EFA_IFACE", "rdmap0s6, udp-127.0.0.1")]);
    assert!(c.iface_allows("rdmap0s6"));
    assert!(c.iface_allows("udp-127.0.0.1"));
    assert!(!c.iface_allows("RDMAP0S6"));
    assert!(!c.iface_allows("loopback0"));
    assert!(Config::default().iface_allows("whatever"));
}

#[test]
fn device_rdma_choice() {
    use efa::device::DeviceCaps;
    let rdma = DeviceCaps {
        rdma_read: true,
        rdma_write: true,
        ..DeviceCaps::default()
    };
    let none = DeviceCaps::default();
    let unset = Config::default();
    assert!(unset.device_rdma(rdma.rdma_read).unwrap());
    assert!(!unset.device_rdma(none.rdma_read).unwrap());
    let off = cfg(&[("FI_EFA_USE_DEVICE_RDMA", "0")]);
    assert!(!off.device_rdma(rdma.rdma_read).unwrap());
    let on = cfg(&[("FI_EFA_USE_DEVICE_RDMA", "1")]);
    assert!(on.device_rdma(rdma.rdma_read).unwrap());
    // As in libfabric, RDMA read decides (a device with read but no write still uses it).
    let read_only = DeviceCaps {
        rdma_read: true,
        ..DeviceCaps::default()
    };
    assert!(unset.device_rdma(read_only.rdma_read).unwrap());
    let e = on.device_rdma(none.rdma_read).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.op(), "FI_EFA_USE_DEVICE_RDMA");
}

#[test]
fn serde_round_trip() {
    for c in [Config::default(), all_changed()] {
        let json = serde_json::to_string(&c).unwrap();
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
    }
    // Durations are integer microseconds; unset options are null.
    let v = serde_json::to_value(Config::default()).unwrap();
    assert_eq!(v["max_timeout"], 1_000_000);
    assert_eq!(v["timeout_interval"], 0);
    assert!(v["use_device_rdma"].is_null());
    assert_eq!(v["recvwin_size"], 16);
}

#[test]
fn serde_partial_and_unknown_fields() {
    let c: Config = serde_json::from_str(r#"{"recvwin_size": 64, "max_timeout": 5}"#).unwrap();
    assert_eq!(c.recvwin_size, 64);
    assert_eq!(c.max_timeout, Duration::from_micros(5));
    assert_eq!(c.cq_size, 8192);
    assert!(serde_json::from_str::<Config>(r#"{"recvwin": 64}"#).is_err());
}

#[test]
fn env_round_trip_and_display() {
    let c = all_changed();
    assert_eq!(Config::from_vars(c.to_env_vars()).unwrap(), c);
    let d = Config::default();
    // Unset options are not printed.
    assert!(
        !d.to_env_vars()
            .iter()
            .any(|(k, _)| k == "FI_EFA_USE_DEVICE_RDMA")
    );
    let text = d.to_string();
    assert!(text.contains("FI_EFA_RECVWIN_SIZE=16\n"), "{text}");
    assert!(text.contains("FI_EFA_MAX_TIMEOUT=1000000\n"), "{text}");
    assert!(text.contains("FI_EFA_RX_COPY_OOO=1\n"), "{text}");
}

#[test]
fn docs_table_lists_every_variable() {
    let doc = include_str!("../docs/config.md");
    for name in Config::env_var_names() {
        assert!(
            doc.contains(&format!("`{name}`")),
            "docs/config.md lacks {name}"
        );
    }
}

/// The "Effect here" column of docs/config.md against the source: a variable said to have an
/// effect is read outside `src/config.rs`, one whose effect is "None" is read nowhere.
#[test]
fn docs_effects_match_what_the_code_reads() {
    fn sources(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("src/config.rs") {
                out.push((
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap(),
                ));
            }
        }
    }
    let mut files = Vec::new();
    sources(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    // `Config` methods that read a field for their callers.
    let via_method = [
        ("iface", "iface_allows("),
        ("use_device_rdma", "device_rdma("),
        ("use_huge_page", "huge_pages("),
        ("fork_safe", "huge_pages("),
    ];
    let read = |field: &str| {
        let dotted = format!(".{field}");
        files.iter().any(|(_, text)| {
            text.match_indices(&dotted).any(|(i, _)| {
                let next = text[i + dotted.len()..].chars().next();
                !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        }) || via_method
            .iter()
            .any(|(f, m)| *f == field && files.iter().any(|(_, t)| t.contains(m)))
    };
    let doc = include_str!("../docs/config.md");
    let mut rows = 0;
    for line in doc.lines().filter(|l| l.starts_with("| `FI_EFA_")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        let (var, field, effect) = (cells[0], cells[1], cells[cells.len() - 1]);
        let field = field.trim_matches('`').split(':').next().unwrap();
        let none = effect.starts_with("None");
        assert_eq!(
            read(field),
            !none,
            "docs/config.md says {var} (`{field}`) has effect {effect:?}, but the code {}",
            if none { "reads it" } else { "never reads it" }
        );
        rows += 1;
    }
    assert_eq!(
        rows,
        Config::env_var_names().count(),
        "one row per variable"
    );
}
