//! Discovery: capabilities, endpoint types, `Info` built from hand-made device attributes, its
//! `fi_info`-style output and serde form, and `getinfo`.
mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::Arc;

use efa::device::{DeviceAttr, DeviceCaps, DeviceKind};
use efa::info::{
    AvType, DGRAM_MSG_PREFIX_SIZE, DeviceSpec, Mode, MrMode, MsgOrder, PROVIDER_VERSION, Progress,
    ResourceMgmt, Threading,
};
use efa::{Caps, Config, EpType, ErrorKind, Gid, Hints, Info, getinfo};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn udp_attr() -> DeviceAttr {
    let mut a = DeviceAttr::software(
        DeviceKind::Udp,
        "udp-127.0.0.1".into(),
        Gid::from_ip(LOCALHOST),
        8192,
        1000,
        1000,
    );
    a.caps = DeviceCaps::default();
    a
}

fn dgram_info() -> Info {
    Info::for_device(
        DeviceKind::Udp,
        &udp_attr(),
        EpType::Dgram,
        Config::default(),
        DeviceSpec::udp(LOCALHOST),
    )
}

fn rdm_info(config: Config) -> Info {
    Info::for_device(
        DeviceKind::Udp,
        &udp_attr(),
        EpType::Rdm,
        config,
        DeviceSpec::udp(LOCALHOST),
    )
}

// ------------------------------------------------------------------------------------------
// Caps and other flags
// ------------------------------------------------------------------------------------------

#[test]
fn caps_ops_and_display() {
    let c = Caps::MSG | Caps::SOURCE | Caps::SEND;
    assert!(c.contains(Caps::MSG | Caps::SOURCE));
    assert!(!c.contains(Caps::MSG | Caps::TAGGED));
    assert!(c.intersects(Caps::TAGGED | Caps::SEND));
    assert_eq!(c - Caps::SEND, Caps::MSG | Caps::SOURCE);
    assert_eq!(c & Caps::MSG, Caps::MSG);
    assert!(Caps::empty().is_empty());
    assert!(c.contains(Caps::empty()));
    // fi_tostr order (libfabric bit order) and bracket format.
    assert_eq!(c.to_string(), "[ FI_MSG, FI_SEND, FI_SOURCE ]");
    assert_eq!(Caps::empty().to_string(), "[  ]");
    assert_eq!(format!("{:?}", Caps::MSG), "Caps([ FI_MSG ])");
    // libfabric's bit values.
    assert_eq!(Caps::MSG.bits(), 1 << 1);
    assert_eq!(Caps::TAGGED.bits(), 1 << 3);
    assert_eq!(Caps::SOURCE.bits(), 1 << 57);
    assert_eq!(Caps::DIRECTED_RECV.bits(), 1 << 59);
    assert_eq!(Caps::from_bits_truncate(1 << 1 | 1 << 0), Caps::MSG);
    let names: Vec<_> = c.names().collect();
    assert_eq!(names, ["FI_MSG", "FI_SEND", "FI_SOURCE"]);
}

#[test]
fn caps_parse() {
    let want = Caps::MSG | Caps::TAGGED | Caps::SOURCE;
    for s in [
        "FI_MSG|FI_TAGGED|FI_SOURCE",
        "msg, tagged, source",
        "[ FI_MSG, FI_TAGGED, FI_SOURCE ]",
        "Fi_Msg tagged FI_SOURCE",
    ] {
        assert_eq!(s.parse::<Caps>().unwrap(), want, "{s}");
    }
    assert_eq!("".parse::<Caps>().unwrap(), Caps::empty());
    assert_eq!("[  ]".parse::<Caps>().unwrap(), Caps::empty());
    // Display round-trips.
    let all = Caps::all();
    assert_eq!(all.to_string().parse::<Caps>().unwrap(), all);
    let e = "FI_MSG, FI_BOGUS".parse::<Caps>().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("FI_BOGUS"), "{e}");
}

#[test]
fn caps_serde_is_a_list_of_names() {
    let c = Caps::MSG | Caps::DELIVERY_COMPLETE;
    let v = serde_json::to_value(c).unwrap();
    assert_eq!(v, serde_json::json!(["FI_MSG", "FI_DELIVERY_COMPLETE"]));
    let back: Caps = serde_json::from_value(v).unwrap();
    assert_eq!(back, c);
    let short: Caps = serde_json::from_str(r#"["msg", "delivery_complete"]"#).unwrap();
    assert_eq!(short, c);
    let one: Caps = serde_json::from_str(r#""FI_MSG|FI_DELIVERY_COMPLETE""#).unwrap();
    assert_eq!(one, c);
    assert!(serde_json::from_str::<Caps>(r#"["FI_NOPE"]"#).is_err());
}

#[test]
fn other_flags() {
    assert_eq!(MsgOrder::empty().to_string(), "[  ]");
    assert_eq!(
        (MsgOrder::SAS | MsgOrder::ATOMIC_WAW).to_string(),
        "[ FI_ORDER_SAS, FI_ORDER_ATOMIC_WAW ]"
    );
    assert_eq!("sas".parse::<MsgOrder>().unwrap(), MsgOrder::SAS);
    assert_eq!(
        (MrMode::ALLOCATED | MrMode::PROV_KEY | MrMode::VIRT_ADDR).to_string(),
        "[ FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY ]"
    );
    assert_eq!(Mode::MSG_PREFIX.to_string(), "[ FI_MSG_PREFIX ]");
    assert_eq!(Mode::MSG_PREFIX.bits(), 1 << 58);
}

// ------------------------------------------------------------------------------------------
// EpType
// ------------------------------------------------------------------------------------------

#[test]
fn ep_type_parse_and_display() {
    for (s, t) in [
        ("rdm", EpType::Rdm),
        ("dgram", EpType::Dgram),
        ("RDM", EpType::Rdm),
        ("FI_EP_DGRAM", EpType::Dgram),
        (" fi_ep_rdm ", EpType::Rdm),
    ] {
        assert_eq!(s.parse::<EpType>().unwrap(), t, "{s}");
    }
    let e = "msg".parse::<EpType>().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("rdm or dgram"), "{e}");
    assert_eq!(EpType::Rdm.to_string(), "FI_EP_RDM");
    assert_eq!(EpType::Dgram.to_string(), "FI_EP_DGRAM");
}

#[test]
fn ep_type_serde() {
    assert_eq!(
        serde_json::to_string(&EpType::Dgram).unwrap(),
        r#""FI_EP_DGRAM""#
    );
    let t: EpType = serde_json::from_str(r#""FI_EP_RDM""#).unwrap();
    assert_eq!(t, EpType::Rdm);
    let t: EpType = serde_json::from_str(r#""dgram""#).unwrap();
    assert_eq!(t, EpType::Dgram);
}

// ------------------------------------------------------------------------------------------
// Info built from hand-made attributes
// ------------------------------------------------------------------------------------------

#[test]
fn dgram_info_attributes() {
    let i = dgram_info();
    assert_eq!(i.provider, DeviceKind::Udp);
    assert_eq!(i.fabric, "udp");
    assert_eq!(i.domain, "udp-127.0.0.1-dgrm");
    assert_eq!(i.version, PROVIDER_VERSION);
    assert_eq!(i.ep_type, EpType::Dgram);
    assert_eq!(
        i.caps,
        Caps::MSG | Caps::SEND | Caps::RECV | Caps::SOURCE | Caps::LOCAL_COMM | Caps::REMOTE_COMM
    );
    assert_eq!(i.mode, Mode::empty());
    assert_eq!(i.addr_format, "FI_ADDR_EFA");
    assert_eq!(i.addrlen, 32);
    assert_eq!(i.protocol, "FI_PROTO_EFA");
    assert_eq!(i.protocol_version, 1);
    // Device-derived sizes.
    assert_eq!(i.ep_attr.max_msg_size, 8192);
    assert_eq!(i.tx_attr.max_msg_size, 8192);
    assert_eq!(i.tx_attr.inject_size, 32);
    assert_eq!(i.tx_attr.iov_limit, 2);
    assert_eq!(i.rx_attr.iov_limit, 2);
    assert_eq!(i.tx_attr.size, 512); // rounddown_pow2(1000)
    assert_eq!(i.rx_attr.size, 256); // rounddown_pow2(1000 / 2)
    assert_eq!(i.tx_attr.msg_order, MsgOrder::empty());
    assert_eq!(i.rx_attr.msg_order, MsgOrder::empty());
    assert_eq!(i.rx_attr.total_buffered_recv, 0);
    assert_eq!(i.ep_attr.msg_prefix_size, 0);
    assert_eq!(i.ep_attr.mem_tag_format, 0);
    // Domain.
    let d = &i.domain_attr;
    assert_eq!(d.name, i.domain);
    assert_eq!(d.threading, Threading::Domain);
    assert_eq!(d.progress, Progress::Manual);
    assert_eq!(d.resource_mgmt, ResourceMgmt::Disabled);
    assert_eq!(d.av_type, AvType::Table);
    assert_eq!(d.mr_key_size, 8);
    assert_eq!(d.cq_data_size, 4);
    assert!(!d.mr_mode.contains(MrMode::LOCAL));
    assert_eq!(i.device, udp_attr());
    assert_eq!(i.config, Config::default());
    assert_eq!(i.spec.kind(), DeviceKind::Udp);
    // FI_EFA_TX_SIZE / RX_SIZE do not apply to DGRAM (as in libfabric).
    let c = Config::default().with_tx_size(64).with_rx_size(64);
    let i = Info::for_device(
        DeviceKind::Udp,
        &udp_attr(),
        EpType::Dgram,
        c,
        DeviceSpec::udp(LOCALHOST),
    );
    assert_eq!((i.tx_attr.size, i.rx_attr.size), (512, 256));
}

#[test]
fn dgram_msg_prefix_mode() {
    let i = dgram_info().with_msg_prefix();
    assert!(i.mode.contains(Mode::MSG_PREFIX));
    assert_eq!(i.ep_attr.msg_prefix_size, DGRAM_MSG_PREFIX_SIZE);
    assert_eq!(DGRAM_MSG_PREFIX_SIZE, 40);
    let r = rdm_info(Config::default()).with_msg_prefix();
    assert!(r.mode.is_empty());
    assert_eq!(r.ep_attr.msg_prefix_size, 0);
}

#[test]
fn rdm_info_attributes() {
    let i = rdm_info(Config::default());
    assert_eq!(i.domain, "udp-127.0.0.1-rdm");
    assert_eq!(i.ep_type, EpType::Rdm);
    for c in [
        Caps::MSG,
        Caps::TAGGED,
        Caps::SOURCE,
        Caps::MULTI_RECV,
        Caps::DIRECTED_RECV,
        Caps::DELIVERY_COMPLETE,
        Caps::LOCAL_COMM,
        Caps::REMOTE_COMM,
    ] {
        assert!(i.caps.contains(c), "RDM lacks {c}");
    }
    for c in [
        Caps::RMA,
        Caps::ATOMIC,
        Caps::READ,
        Caps::WRITE,
        Caps::REMOTE_READ,
        Caps::REMOTE_WRITE,
    ] {
        assert!(i.caps.contains(c), "RDM lacks {c}");
    }
    // Device memory: dmabuf regions on every device (`Domain::register_dmabuf`).
    assert!(i.caps.contains(Caps::HMEM));
    assert!(i.domain_attr.mr_mode.contains(MrMode::HMEM));
    assert_eq!(i.protocol_version, 4);
    assert_eq!(i.ep_attr.max_msg_size, u64::MAX);
    assert!(i.tx_attr.msg_order.contains(MsgOrder::SAS));
    assert!(i.rx_attr.msg_order.contains(MsgOrder::SAS));
    assert_eq!(i.tx_attr.iov_limit, 4);
    assert_eq!(i.domain_attr.threading, Threading::Safe);
    assert_eq!(i.domain_attr.resource_mgmt, ResourceMgmt::Enabled);
    assert_eq!(i.domain_attr.progress, Progress::Manual);
    assert_eq!(i.ep_attr.mem_tag_format, 0xaaaa_aaaa_aaaa_aaaa);
    // Inject: min(mtu - 168, 4096) with shm transfer on, mtu - 168 without.
    assert_eq!(i.tx_attr.inject_size, 4096);
    let no_shm = rdm_info(Config::default().with_enable_shm_transfer(false));
    assert_eq!(no_shm.tx_attr.inject_size, 8192 - 168);
    // Sizes: device by default, FI_EFA_TX_SIZE / RX_SIZE when set.
    assert_eq!((i.tx_attr.size, i.rx_attr.size), (512, 256));
    let sized = rdm_info(Config::default().with_tx_size(43).with_rx_size(51));
    assert_eq!((sized.tx_attr.size, sized.rx_attr.size), (43, 51));
    assert_eq!(Info::ep_caps(EpType::Rdm), i.caps);
    assert_eq!(Info::ep_caps(EpType::Dgram), dgram_info().caps);
}

#[test]
fn info_display_is_fi_info_short_form() {
    let text = dgram_info().to_string();
    assert_eq!(
        text,
        format!(
            "provider: udp\n    fabric: udp\n    domain: udp-127.0.0.1-dgrm\n    version: \
             {PROVIDER_VERSION}\n    type: FI_EP_DGRAM\n    protocol: FI_PROTO_EFA"
        )
    );
    assert_eq!(PROVIDER_VERSION, "0.1");
}

#[test]
fn info_verbose_lists_every_attribute() {
    let text = dgram_info().with_msg_prefix().verbose().to_string();
    for line in [
        "---",
        "fi_info:",
        "    caps: [ FI_MSG, FI_RECV, FI_SEND, FI_LOCAL_COMM, FI_REMOTE_COMM, FI_SOURCE ]",
        "    mode: [ FI_MSG_PREFIX ]",
        "    addr_format: FI_ADDR_EFA",
        "    src_addrlen: 32",
        "    src_addr: efa://[::ffff:127.0.0.1]:0:00000000",
        "    fi_tx_attr:",
        "        msg_order: [  ]",
        "        inject_size: 32",
        "        size: 512",
        "        iov_limit: 2",
        "    fi_rx_attr:",
        "        size: 256",
        "        total_buffered_recv: 0",
        "    fi_ep_attr:",
        "        type: FI_EP_DGRAM",
        "        protocol: FI_PROTO_EFA",
        "        protocol_version: 1",
        "        max_msg_size: 8192",
        "        msg_prefix_size: 40",
        "        mem_tag_format: 0x0",
        "    fi_domain_attr:",
        "        name: udp-127.0.0.1-dgrm",
        "        threading: FI_THREAD_DOMAIN",
        "        progress: FI_PROGRESS_MANUAL",
        "        resource_mgmt: FI_RM_DISABLED",
        "        av_type: FI_AV_TABLE",
        "        mr_mode: [ FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY ]",
        "        mr_key_size: 8",
        "        cq_data_size: 4",
        "        caps: [ FI_LOCAL_COMM, FI_REMOTE_COMM ]",
        "    fi_fabric_attr:",
        "        name: udp",
        "        prov_name: udp",
        "    nic:",
        "            name: udp-127.0.0.1",
        "            max_sge: 2",
        "            rdma_read: false",
        "            pci_addr: (null)",
        "            mtu: 8192",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing line {line:?} in\n{text}"
        );
    }
    let rdm = rdm_info(Config::default()).verbose().to_string();
    assert!(rdm.contains("        threading: FI_THREAD_SAFE\n"), "{rdm}");
    assert!(
        rdm.contains("        mem_tag_format: 0xaaaaaaaaaaaaaaaa\n"),
        "{rdm}"
    );
    assert!(
        rdm.contains(&format!("        max_msg_size: {}\n", u64::MAX)),
        "{rdm}"
    );
}

#[test]
fn info_serializes_every_attribute() {
    let v = serde_json::to_value(dgram_info()).unwrap();
    assert_eq!(v["provider"], "udp");
    assert_eq!(v["domain"], "udp-127.0.0.1-dgrm");
    assert_eq!(v["ep_type"], "FI_EP_DGRAM");
    assert_eq!(v["caps"][0], "FI_MSG");
    assert_eq!(v["addr_format"], "FI_ADDR_EFA");
    assert_eq!(v["protocol"], "FI_PROTO_EFA");
    assert_eq!(v["tx_attr"]["inject_size"], 32);
    assert_eq!(v["ep_attr"]["max_msg_size"], 8192);
    assert_eq!(v["domain_attr"]["threading"], "FI_THREAD_DOMAIN");
    assert_eq!(v["domain_attr"]["progress"], "FI_PROGRESS_MANUAL");
    assert_eq!(v["device"]["mtu"], 8192);
    assert_eq!(v["config"]["recvwin_size"], 16);
    assert!(v.get("spec").is_none());
    assert!(v.get("handle").is_none());
}

// ------------------------------------------------------------------------------------------
// getinfo without devices (the filters that run before any device is opened)
// ------------------------------------------------------------------------------------------

#[track_caller]
fn no_data(hints: Hints, detail_has: &str) {
    match getinfo(&hints) {
        Ok(v) => panic!("{hints:?} matched {v:?}"),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::NoData, "{e}");
            assert_eq!(e.op(), "getinfo");
            assert!(e.to_string().contains(detail_has), "{e}");
        }
    }
}

#[test]
fn getinfo_unknown_provider() {
    no_data(
        Hints::new().provider("verbs").config(Config::default()),
        "no provider named \"verbs\"",
    );
}

#[test]
fn getinfo_unavailable_providers() {
    #[cfg(not(feature = "efa"))]
    no_data(
        Hints::new().provider("efa").config(Config::default()),
        "cargo feature `efa`",
    );
}

/// RMA and atomics select RDM endpoints only (DGRAM has neither).
#[test]
fn rma_and_atomics_select_rdm() {
    for caps in [Caps::MSG | Caps::RMA, Caps::ATOMIC] {
        let infos = getinfo(&Hints::new().caps(caps).config(Config::default())).unwrap();
        assert!(!infos.is_empty());
        assert!(
            infos
                .iter()
                .all(|i| i.ep_type == EpType::Rdm && i.caps.contains(caps))
        );
    }
    no_data(
        Hints::new()
            .ep_type(EpType::Dgram)
            .caps(Caps::RMA)
            .config(Config::default()),
        "FI_EP_DGRAM",
    );
}

#[test]
fn getinfo_refuses_an_invalid_config_in_hints() {
    let bad = Config::default().with_recvwin_size(12);
    let e = getinfo(&Hints::new().config(bad)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.op(), "FI_EFA_RECVWIN_SIZE");
}

/// Runs `child_getinfo_env` in a child process whose environment holds `var=value`, so the
/// test's own process environment is never modified.
fn run_env_child(var: &str, value: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_getinfo_env", "--nocapture"])
        .env("EFA_INFO_TEST_CHILD_OP", var)
        .env(var, value)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("1 passed"),
        "child did not run:\n{stdout}\n{stderr}"
    );
}

/// Only does something inside `run_env_child`.
#[test]
fn child_getinfo_env() {
    let Some(op) = std::env::var_os("EFA_INFO_TEST_CHILD_OP") else {
        return;
    };
    let e = getinfo(&Hints::new()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert_eq!(e.op(), op.to_str().unwrap(), "{e}");
}

#[test]
fn getinfo_fails_on_invalid_env_value() {
    run_env_child("FI_EFA_RECVWIN_SIZE", "12");
    run_env_child("FI_EFA_RX_COPY_OOO", "maybe");
}

#[test]
fn getinfo_fails_on_deprecated_env_variable() {
    run_env_child("FI_EFA_MTU_SIZE", "8192");
}

// ------------------------------------------------------------------------------------------
// getinfo with devices
// ------------------------------------------------------------------------------------------

fn hints() -> Hints {
    Hints::new().config(Config::default())
}

#[test]
fn getinfo_lists_udp_then_loopback_rdm_then_dgram() {
    let all = getinfo(&hints()).unwrap();
    let listing: Vec<_> = all.iter().map(|i| (i.provider, i.ep_type)).collect();
    assert_eq!(
        listing,
        [
            (DeviceKind::Udp, EpType::Rdm),
            (DeviceKind::Udp, EpType::Dgram),
            (DeviceKind::Shm, EpType::Rdm),
            (DeviceKind::Shm, EpType::Dgram),
            (DeviceKind::Loopback, EpType::Rdm),
            (DeviceKind::Loopback, EpType::Dgram)
        ]
    );
    for i in all.iter().filter(|i| i.ep_type == EpType::Rdm) {
        assert_eq!(i.domain, format!("{}-rdm", i.device.name));
        assert_eq!(i.ep_attr.max_msg_size, u64::MAX);
        assert_eq!(i.domain_attr.threading, Threading::Safe);
        assert!(
            i.caps
                .contains(Caps::TAGGED | Caps::DIRECTED_RECV | Caps::MULTI_RECV)
        );
        assert!(i.caps.contains(Caps::RMA | Caps::ATOMIC));
    }
    let infos: Vec<Info> = all
        .into_iter()
        .filter(|i| i.ep_type == EpType::Dgram)
        .collect();
    for i in &infos {
        assert_eq!(i.domain, format!("{}-dgrm", i.device.name));
        assert_eq!(i.fabric, i.provider.name());
        assert_eq!(i.device.kind, i.provider);
        assert_eq!(i.ep_attr.max_msg_size, i.device.mtu as u64);
        assert_eq!(i.tx_attr.inject_size, i.device.inline_size);
        assert_eq!(i.tx_attr.iov_limit, i.device.max_sge);
        assert!(i.tx_attr.size.is_power_of_two());
        assert_eq!(i.domain_attr.threading, Threading::Domain);
        let text = i.to_string();
        assert!(text.starts_with(&format!("provider: {}\n", i.provider)));
        assert!(text.contains(&format!("    domain: {}\n", i.domain)));
    }
    // Caps both kinds have list both; caps only RDM has list only RDM.
    let with_caps = getinfo(&hints().caps(Caps::MSG | Caps::SOURCE)).unwrap();
    assert_eq!(with_caps.len(), 6);
    let tagged = getinfo(&hints().caps(Caps::TAGGED)).unwrap();
    assert!(tagged.iter().all(|i| i.ep_type == EpType::Rdm));
    assert_eq!(tagged.len(), 3);
    let json = serde_json::to_value(&infos).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 3);
}

#[test]
fn getinfo_provider_filter() {
    for (name, kind) in [
        ("udp", DeviceKind::Udp),
        ("loopback", DeviceKind::Loopback),
        ("shm", DeviceKind::Shm),
        ("UDP", DeviceKind::Udp),
    ] {
        let infos = getinfo(&hints().provider(name).ep_type(EpType::Dgram)).unwrap();
        assert_eq!(infos.len(), 1, "{name}");
        assert_eq!(infos[0].provider, kind);
    }
}

#[test]
fn getinfo_udp_binds_hint_addr() {
    let ip: IpAddr = "127.0.0.2".parse().unwrap();
    let infos = getinfo(&hints().provider("udp").addr(ip)).unwrap();
    assert_eq!(infos[0].device.gid, Gid::from_ip(ip));
    let infos = getinfo(&hints().provider("udp")).unwrap();
    assert_eq!(infos[0].device.gid, Gid::from_ip(LOCALHOST));
}

#[test]
fn getinfo_domain_and_iface_filters() {
    let all = getinfo(&hints()).unwrap();
    let udp = all
        .iter()
        .find(|i| i.provider == DeviceKind::Udp && i.ep_type == EpType::Dgram)
        .unwrap();
    // By device name (both endpoint types) and by domain name (one).
    let got = getinfo(&hints().domain(&udp.device.name)).unwrap();
    assert_eq!(got.len(), 2);
    assert!(got.iter().all(|i| i.device.name == udp.device.name));
    let got = getinfo(&hints().domain(&udp.domain)).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].domain, udp.domain);
    no_data(hints().domain("no-such-device"), "domain no-such-device");
    // FI_EFA_IFACE (here through the hints' config).
    let only_udp = Config::default().with_iface(udp.device.name.clone());
    let got = getinfo(&Hints::new().config(only_udp)).unwrap();
    assert_eq!(got.len(), 2, "RDM and DGRAM on the udp device");
    assert!(got.iter().all(|i| i.provider == DeviceKind::Udp));
    let none = Config::default().with_iface("rdmap99s0");
    no_data(Hints::new().config(none), "FI_EFA_IFACE=rdmap99s0");
}

#[test]
fn getinfo_info_opens_its_device() {
    for info in getinfo(&hints()).unwrap() {
        let a = info.open_device().unwrap();
        let b = info.open_device().unwrap();
        // Every domain on this info shares the device discovery opened.
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.attr(), &info.device);
        assert_eq!(info.clone().open_device().unwrap().attr(), &info.device);
        // A hand-built info opens a device from its spec.
        let fresh = Info::for_device(
            info.provider,
            &info.device,
            info.ep_type,
            Config::default(),
            info.spec.clone(),
        );
        assert_eq!(fresh.open_device().unwrap().attr().kind, info.provider);
    }
}

#[test]
fn getinfo_msg_prefix_mode() {
    let infos = getinfo(&hints().mode(Mode::MSG_PREFIX)).unwrap();
    assert!(!infos.is_empty());
    // The prefix applies to DGRAM endpoints; RDM ones have none.
    for i in infos.iter().filter(|i| i.ep_type == EpType::Rdm) {
        assert_eq!(i.ep_attr.msg_prefix_size, 0);
    }
    for i in infos.into_iter().filter(|i| i.ep_type == EpType::Dgram) {
        assert!(i.mode.contains(Mode::MSG_PREFIX));
        assert_eq!(i.ep_attr.msg_prefix_size, 40);
    }
}

/// A configuration warning reaches the user of an example without any `RUST_LOG`: the examples
/// send the library's warnings to stderr by default (issue 18, point 4).
#[test]
fn example_shows_configuration_warnings_without_rust_log() {
    let Some(bin) = common::example_bin("info") else {
        return;
    };
    let out = std::process::Command::new(&bin)
        .args(["-p", "loopback"])
        .env_remove("RUST_LOG")
        .env("FI_EFA_NO_SUCH_SETTING", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("FI_EFA_NO_SUCH_SETTING") && stderr.contains("ignored"),
        "{stderr}"
    );
}

/// `info --json` writes integers above 2^53 as strings (JSON readers that use doubles would round
/// them) and GIDs as text, as `-v` prints them (issue 18, point 7).
#[test]
fn info_json_is_exact_for_javascript_and_gids_are_text() {
    let Some(bin) = common::example_bin("info") else {
        return;
    };
    let out = std::process::Command::new(&bin)
        .args(["-p", "udp", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    fn walk(v: &serde_json::Value, big: &mut usize, gids: &mut Vec<String>) {
        match v {
            serde_json::Value::Number(n) => {
                assert!(
                    n.as_u64().is_none_or(|x| x <= 1 << 53),
                    "{n} would be rounded"
                );
            }
            serde_json::Value::String(s) if s.parse::<u64>().is_ok_and(|x| x > 1 << 53) => {
                *big += 1;
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, big, gids)),
            serde_json::Value::Object(o) => {
                for (k, x) in o {
                    if k == "gid" {
                        gids.push(x.as_str().expect("a GID as text").to_string());
                    }
                    walk(x, big, gids);
                }
            }
            _ => {}
        }
    }
    let (mut big, mut gids) = (0, Vec::new());
    walk(&v, &mut big, &mut gids);
    assert!(big > 0, "max_msg_size of RDM is 2^64 - 1: {v}");
    assert!(!gids.is_empty(), "{v}");
    for g in gids {
        assert!(g.parse::<std::net::IpAddr>().is_ok(), "{g}");
    }
    // And a GID reads back from its text.
    let g: Gid = serde_json::from_str("\"::ffff:127.0.0.1\"").unwrap();
    assert_eq!(serde_json::to_string(&g).unwrap(), "\"::ffff:127.0.0.1\"");
}

/// docs/getting-started.md's capability tables against what `getinfo` returns on every software
/// device.
#[test]
fn getting_started_capability_tables_match_getinfo() {
    let doc = include_str!("../docs/getting-started.md");
    let cell = |row: &str| -> String {
        let line = doc
            .lines()
            .find(|l| l.starts_with(&format!("| {row} |")))
            .unwrap_or_else(|| panic!("docs/getting-started.md has no row {row}"));
        line.trim_matches('|')
            .split(" | ")
            .nth(1)
            .unwrap()
            .trim()
            .to_string()
    };
    for provider in ["udp", "shm", "loopback"] {
        for (ep_type, row) in [
            (EpType::Rdm, "`EpType::Rdm`"),
            (EpType::Dgram, "`EpType::Dgram`"),
        ] {
            let infos = getinfo(&Hints::new().provider(provider).ep_type(ep_type)).unwrap();
            assert!(!infos.is_empty(), "{provider} {ep_type}");
            for info in &infos {
                assert_eq!(
                    format!("`{}`", info.caps),
                    cell(row),
                    "{provider} {ep_type}: docs/getting-started.md's caps differ"
                );
                let c = &info.device.caps;
                let said = cell(&format!("`{provider}`"));
                assert_eq!(
                    said.starts_with("read and write"),
                    c.rdma_read && c.rdma_write,
                    "{provider}: the doc says {said:?}, the device has {c:?}"
                );
            }
        }
    }
}
