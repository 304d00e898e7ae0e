//! Unit tests of the tables and small types; the codec itself is tested in `tests/wire.rs`.

use super::*;
use crate::device::RemoteIov;
use crate::{Gid, RawAddr};

#[test]
fn packet_type_table_is_consistent() {
    let mut n = 0;
    for id in 0..=255u8 {
        match PacketType::from_id(id) {
            Some(t) => {
                n += 1;
                assert_eq!(t.id(), id);
                assert_eq!(u8::from(t), id);
                assert_eq!(PacketType::try_from(id), Ok(t));
                assert!(PacketType::ALL.contains(&t));
            }
            None => assert_eq!(PacketType::try_from(id), Err(WireError::UnknownType(id))),
        }
    }
    assert_eq!(n, PacketType::ALL.len());
    assert!(PacketType::ALL.windows(2).all(|w| w[0] < w[1]));
    let mut names: Vec<_> = PacketType::ALL.iter().map(|t| t.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), PacketType::ALL.len());

    for &t in PacketType::ALL {
        let name = t.name();
        assert_eq!(t.is_req(), t.id() >= 64, "{t}");
        assert_eq!(t.is_tagged(), name.contains("TAGRTM"), "{t}");
        assert_eq!(t.is_dc(), name.starts_with("DC_"), "{t}");
        assert_eq!(t.is_rtm(), name.ends_with("RTM"), "{t}");
        assert_eq!(t.base_hdr_len().is_some(), t.is_decodable(), "{t}");
        if t.is_decodable() && t.is_req() {
            let rma = name.ends_with("RTW") || name.ends_with("RTR") || name.ends_with("RTA");
            assert_eq!(t.has_rma_iov(), rma, "{t}");
            assert_eq!(
                t.has_read_iov(),
                name.starts_with("LONGREAD") || name.starts_with("RUNTREAD"),
                "{t}"
            );
        } else {
            assert!(!t.has_rma_iov() && !t.has_read_iov(), "{t}");
        }
        // Tagged id = untagged id + 1 (asserted by libfabric's efa_rdm_msg_select_rtm).
        if t.is_tagged() {
            let untagged = PacketType::from_id(t.id() - 1).unwrap();
            assert_eq!(untagged.name(), name.replace("TAGRTM", "MSGRTM"));
        }
        // Mandatory headers are 8-byte multiples except PEER_ERROR (20).
        if let Some(len) = t.base_hdr_len() {
            assert!(len % 8 == 0 || t == PacketType::PeerError, "{t}");
        }
    }
    assert_eq!(
        PacketType::EagerMsgRtm.to_string(),
        "EAGER_MSGRTM (64)".to_string()
    );
}

#[test]
fn iov_list_wire_and_slice_agree() {
    let iovs = [
        RemoteIov {
            addr: 1,
            len: 2,
            key: 3,
        },
        RemoteIov {
            addr: u64::MAX,
            len: u64::MAX,
            key: 6,
        },
    ];
    let mut wire = Vec::new();
    for v in &iovs {
        for x in [v.addr, v.len, v.key] {
            wire.extend_from_slice(&x.to_le_bytes());
        }
    }
    let a = IovList::new(&iovs);
    let b = IovList::from_wire(&wire);
    assert_eq!(a, b);
    assert_eq!(b.len(), 2);
    assert_eq!(b.get(1), Some(iovs[1]));
    assert_eq!(b.get(2), None);
    assert_eq!(b.get(usize::MAX), None);
    assert_eq!(b.to_vec(), iovs.to_vec());
    assert_eq!(b.iter().len(), 2);
    assert_eq!(b.total_len(), u64::MAX);
    assert_ne!(IovList::new(&iovs[..1]), b);
    assert!(IovList::EMPTY.is_empty());
    assert_eq!(IovList::default(), IovList::from_wire(&[]));
    // A trailing partial entry is not an entry.
    assert_eq!(IovList::from_wire(&wire[..47]).len(), 1);
    assert_eq!(format!("{a:?}"), format!("{:?}", iovs));
}

#[test]
fn extra_info_bits() {
    let mut e = ExtraInfo::new();
    assert_eq!(e.words(), &[0]);
    e.set(ExtraFeature::PeerError);
    e.set(ExtraFeature::RdmaRead);
    assert_eq!(e.words(), &[0b10_0000_0001]);
    assert!(e.has(ExtraFeature::PeerError));
    assert!(!e.has(ExtraFeature::Runt));
    assert_eq!(
        e.features().collect::<Vec<_>>(),
        [ExtraFeature::RdmaRead, ExtraFeature::PeerError]
    );
    e.set_bit(70);
    assert_eq!(e.words(), &[0b10_0000_0001, 1 << 6]);
    assert!(e.has_bit(70));
    assert!(!e.has_bit(200));
    e.set_bit(256); // beyond MAX_NUM_EXINFO words: ignored
    assert_eq!(e.words().len(), 2);
    assert_eq!(
        ExtraInfo::from_words(&[1, 2, 3, 4, 5, 6]).words(),
        &[1, 2, 3, 4]
    );
    assert_eq!(ExtraInfo::empty().words(), &[] as &[u64]);
    assert!(!ExtraInfo::empty().has_bit(0));
    assert_eq!(ExtraFeature::from_bit(10), None);
    let dbg = format!("{:?}", ExtraInfo::with_features(&[ExtraFeature::Runt]));
    assert!(dbg.contains("Runt"), "{dbg}");
}

#[test]
fn req_opt_connid_and_flags() {
    let a = RawAddr::new(Gid([1; 16]), 2, 0x55);
    let o = ReqOpt {
        sender: Sender::RawAddr(a),
        cq_data: Some(1),
    };
    assert_eq!(o.connid(), Some(0x55));
    assert_eq!(o.flags(), req_flags::RAW_ADDR_HDR | req_flags::CQ_DATA_HDR);
    let o = ReqOpt {
        sender: Sender::Connid(9),
        cq_data: None,
    };
    assert_eq!(o.connid(), Some(9));
    assert_eq!(o.flags(), CONNID_HDR);
    assert_eq!(ReqOpt::default().connid(), None);
    assert_eq!(ReqOpt::default().flags(), 0);
}

#[test]
fn wire_error_converts_to_crate_error() {
    for (e, text) in [
        (WireError::Truncated, "truncated"),
        (WireError::BadVersion(3), "version 3"),
        (WireError::UnknownType(200), "type 200"),
        (
            WireError::NotDecodable(PacketType::RetiredRts),
            "RETIRED_RTS (1)",
        ),
        (WireError::BadField("addr_len"), "addr_len"),
    ] {
        assert!(e.to_string().contains(text), "{e}");
        let err: crate::Error = e.into();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidArgument);
        assert_eq!(err.op(), "decode");
        assert!(err.detail().unwrap().contains(text));
    }
}

#[test]
fn rta_kind_ids() {
    assert_eq!(RtaKind::Write.id(), 0);
    assert_eq!(RtaKind::DcWrite { send_id: 4 }.id(), 4);
    assert_eq!(RtaKind::Fetch { recv_id: 5 }.id(), 5);
    assert_eq!(RtaKind::Compare { recv_id: 6 }.id(), 6);
    assert_eq!(
        RtaKind::Compare { recv_id: 6 }.packet_type(),
        PacketType::CompareRta
    );
    assert!(RtaKind::DcWrite { send_id: 0 }.packet_type().is_dc());
}

#[test]
fn base_header_parse() {
    assert_eq!(BaseHeader::parse(&[1, 2]), Err(WireError::Truncated));
    let h = BaseHeader::parse(&[9, 4, 0x0b, 0x80, 0xff]).unwrap();
    assert_eq!(
        h,
        BaseHeader {
            ty: 9,
            version: 4,
            flags: 0x800b
        }
    );
    assert_eq!(h.packet_type(), Ok(PacketType::Handshake));
}
