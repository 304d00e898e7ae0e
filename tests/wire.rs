//! The EFA RDM v4 packet codec against the shared vectors (`tests/vectors/efa-rdm-v4.json`):
//! byte layout of every header, round trips of every packet variant with and without each
//! optional header, totality of the decoder, and the specific error cases.

use bytes::BytesMut;
use efa::device::RemoteIov;
use efa::fault::{Rng, test_seed};
use efa::proto::wire::{
    self, CONNID_HDR, CTS_READ_REQ, ExtraFeature, ExtraInfo, Handshake, IOV_LIMIT, IovList,
    MAX_REQ_HEADER_LEN, Packet, PacketType, ReqOpt, RtaKind, Sender, WireError, decode,
    handshake_flags, peer_error_ref, req_flags, req_header_len,
};
use efa::{Gid, RawAddr};
use proptest::prelude::*;
use serde_json::Value;

const VECTORS: &str = include_str!("vectors/efa-rdm-v4.json");

fn vectors() -> Value {
    serde_json::from_str(VECTORS).expect("vectors parse")
}

// ---------------------------------------------------------------------------------------------
// Distinct, recognisable values for every named field.

const MSG_ID: u32 = 0xA1A2_A3A4;
const TAG: u64 = 0xB1B2_B3B4_B5B6_B7B8;
const MSG_LENGTH: u64 = 0xC1C2_C3C4_C5C6_C7C8;
const SEG_OFFSET: u64 = 0xD1D2_D3D4_D5D6_D7D8;
const SEND_ID: u32 = 0xE1E2_E3E4;
const CREDIT: u32 = 0xF1F2_F3F4;
const RUNT_LENGTH: u64 = 0x9192_9394_9596_9798;
const RECV_ID: u32 = 0x8182_8384;
const RECV_LENGTH: u64 = 0x7172_7374_7576_7778;
const DATATYPE: u32 = 0x6162_6364;
const ATOMIC_OP: u32 = 0x5152_5354;
const CONNID: u32 = 0x4142_4344;
const SEG_LENGTH: u64 = 0x3132_3334_3536_3738;
const OP_ID: u32 = 0x2122_2324;
const REF_KIND: u32 = 0x1112_1314;
const PROV_ERRNO: u32 = 0x0102_0304;

static RMA: [RemoteIov; 3] = [
    RemoteIov {
        addr: 0x1000_0000_0000_0001,
        len: 0x1100_0000_0000_0002,
        key: 0x1200_0000_0000_0003,
    },
    RemoteIov {
        addr: 0x2000_0000_0000_0001,
        len: 0x2100_0000_0000_0002,
        key: 0x2200_0000_0000_0003,
    },
    RemoteIov {
        addr: 0x3000_0000_0000_0001,
        len: 0x3100_0000_0000_0002,
        key: 0x3200_0000_0000_0003,
    },
];

static READ: [RemoteIov; 2] = [
    RemoteIov {
        addr: 0x4000_0000_0000_0001,
        len: 0x4100_0000_0000_0002,
        key: 0x4200_0000_0000_0003,
    },
    RemoteIov {
        addr: 0x5000_0000_0000_0001,
        len: 0x5100_0000_0000_0002,
        key: 0x5200_0000_0000_0003,
    },
];

/// The value a vectors field must hold in [`sample`]'s packets (`None`: not checked by value).
fn field_value(field: &str, ty: PacketType, pkt: &Packet<'_>) -> Option<u64> {
    Some(match field {
        "type" => u64::from(ty.id()),
        "version" => 4,
        "flags" => u64::from(pkt.flags()),
        "msg_id" => u64::from(MSG_ID),
        "tag" => TAG,
        "msg_length" => MSG_LENGTH,
        "seg_offset" => SEG_OFFSET,
        "send_id" | "tx_id" => u64::from(SEND_ID),
        "credit_request" => u64::from(CREDIT),
        "read_iov_count" => READ.len() as u64,
        "rma_iov_count" => RMA.len() as u64,
        "runt_length" => RUNT_LENGTH,
        "recv_id" => u64::from(RECV_ID),
        // u64 in CTS, u32 in LONGCTS_RTR: the low half is the same.
        "recv_length" => RECV_LENGTH,
        "atomic_datatype" => u64::from(DATATYPE),
        "atomic_op" => u64::from(ATOMIC_OP),
        "connid" => u64::from(CONNID),
        "seg_length" => SEG_LENGTH,
        "op_id" => u64::from(OP_ID),
        "ref_kind" => u64::from(REF_KIND),
        "prov_errno" => u64::from(PROV_ERRNO),
        "padding" | "reserved" => 0,
        "nextra_p3" => 4,
        _ => return None,
    })
}

/// A packet of type `ty` with every field set to its distinct value and no optional header.
fn sample(ty: PacketType) -> Packet<'static> {
    use PacketType as T;
    let opt = ReqOpt::default();
    let tag = ty.is_tagged().then_some(TAG);
    let dc_send_id = ty.is_dc().then_some(SEND_ID);
    let rma_iov = IovList::new(&RMA);
    let read_iov = IovList::new(&READ);
    let connid = Some(CONNID);
    match ty {
        T::EagerMsgRtm | T::EagerTagRtm | T::DcEagerMsgRtm | T::DcEagerTagRtm => Packet::EagerRtm {
            opt,
            msg_id: MSG_ID,
            tag,
            dc_send_id,
        },
        T::MediumMsgRtm | T::MediumTagRtm | T::DcMediumMsgRtm | T::DcMediumTagRtm => {
            Packet::MediumRtm {
                opt,
                msg_id: MSG_ID,
                msg_length: MSG_LENGTH,
                seg_offset: SEG_OFFSET,
                tag,
                dc_send_id,
            }
        }
        T::LongCtsMsgRtm | T::LongCtsTagRtm | T::DcLongCtsMsgRtm | T::DcLongCtsTagRtm => {
            Packet::LongCtsRtm {
                opt,
                msg_id: MSG_ID,
                msg_length: MSG_LENGTH,
                send_id: SEND_ID,
                credit_request: CREDIT,
                tag,
                dc: ty.is_dc(),
                read_nack: false,
            }
        }
        T::LongReadMsgRtm | T::LongReadTagRtm => Packet::LongReadRtm {
            opt,
            msg_id: MSG_ID,
            msg_length: MSG_LENGTH,
            send_id: SEND_ID,
            tag,
            read_iov,
        },
        T::RuntReadMsgRtm | T::RuntReadTagRtm => Packet::RuntReadRtm {
            opt,
            msg_id: MSG_ID,
            msg_length: MSG_LENGTH,
            send_id: SEND_ID,
            seg_offset: SEG_OFFSET,
            runt_length: RUNT_LENGTH,
            tag,
            read_iov,
        },
        T::EagerRtw | T::DcEagerRtw => Packet::EagerRtw {
            opt,
            dc_send_id,
            rma_iov,
        },
        T::LongCtsRtw | T::DcLongCtsRtw => Packet::LongCtsRtw {
            opt,
            msg_length: MSG_LENGTH,
            send_id: SEND_ID,
            credit_request: CREDIT,
            dc: ty.is_dc(),
            read_nack: false,
            rma_iov,
        },
        T::LongReadRtw => Packet::LongReadRtw {
            opt,
            msg_length: MSG_LENGTH,
            send_id: SEND_ID,
            rma_iov,
            read_iov,
        },
        T::ShortRtr => Packet::ShortRtr {
            opt,
            msg_length: MSG_LENGTH,
            recv_id: RECV_ID,
            rma_iov,
        },
        T::LongCtsRtr => Packet::LongCtsRtr {
            opt,
            msg_length: MSG_LENGTH,
            recv_id: RECV_ID,
            recv_length: RECV_LENGTH as u32,
            rma_iov,
        },
        T::WriteRta | T::DcWriteRta | T::FetchRta | T::CompareRta => Packet::Rta {
            opt,
            kind: match ty {
                T::WriteRta => RtaKind::Write,
                T::DcWriteRta => RtaKind::DcWrite { send_id: SEND_ID },
                T::FetchRta => RtaKind::Fetch { recv_id: RECV_ID },
                _ => RtaKind::Compare { recv_id: RECV_ID },
            },
            msg_id: MSG_ID,
            atomic_datatype: DATATYPE,
            atomic_op: ATOMIC_OP,
            rma_iov,
        },
        T::Cts => Packet::Cts {
            connid,
            send_id: SEND_ID,
            recv_id: RECV_ID,
            recv_length: RECV_LENGTH,
            read_req: true,
        },
        T::CtsData => Packet::CtsData {
            connid,
            recv_id: RECV_ID,
            seg_length: SEG_LENGTH,
            seg_offset: SEG_OFFSET,
        },
        T::ReadRsp => Packet::ReadRsp {
            connid,
            recv_id: RECV_ID,
            send_id: SEND_ID,
            seg_length: SEG_LENGTH,
        },
        T::Eor => Packet::Eor {
            connid,
            send_id: SEND_ID,
            recv_id: RECV_ID,
        },
        T::AtomRsp => Packet::AtomRsp {
            connid,
            recv_id: RECV_ID,
            seg_length: SEG_LENGTH,
        },
        T::Handshake => Packet::Handshake(Handshake {
            extra_info: ExtraInfo::from_words(&[0x0807_0605_0403_0201]),
            ..Handshake::default()
        }),
        T::Receipt => Packet::Receipt {
            connid,
            send_id: SEND_ID,
            msg_id: MSG_ID,
        },
        T::ReadNack => Packet::ReadNack {
            connid,
            send_id: SEND_ID,
            recv_id: RECV_ID,
        },
        T::PeerError => Packet::PeerError {
            connid,
            op_id: OP_ID,
            ref_kind: REF_KIND,
            prov_errno: PROV_ERRNO,
        },
        other => panic!("{other} is never sent"),
    }
}

fn iov_bytes(iovs: &[RemoteIov]) -> Vec<u8> {
    iovs.iter()
        .flat_map(|v| [v.addr, v.len, v.key])
        .flat_map(u64::to_le_bytes)
        .collect()
}

fn fields(v: &Value) -> Vec<(String, usize, usize)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let f = f.as_array().unwrap();
            (
                f[0].as_str().unwrap().to_string(),
                f[1].as_u64().unwrap() as usize,
                f[2].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

fn json_type_name(name: &str) -> &str {
    name.strip_suffix("_local_only").unwrap_or(name)
}

// ---------------------------------------------------------------------------------------------
// 1. Vectors

#[test]
fn vectors_packet_type_ids() {
    let v = vectors();
    assert_eq!(v["protocol_version"], u64::from(wire::PROTOCOL_VERSION));
    let types = v["packet_types"].as_object().unwrap();
    for (name, id) in types {
        let id = u8::try_from(id.as_u64().unwrap()).unwrap();
        let ty = PacketType::try_from(id).unwrap();
        assert_eq!(ty.name(), json_type_name(name), "id {id}");
        assert_eq!(ty.id(), id);
        // Every type the vectors list is decodable, except the local-only RMA_CONTEXT.
        assert_eq!(
            ty.is_decodable(),
            name != "RMA_CONTEXT_local_only",
            "{name}"
        );
    }
    // ... and every decodable type is listed there, with a header layout.
    for ty in PacketType::ALL.iter().filter(|t| t.is_decodable()) {
        assert!(types.contains_key(ty.name()), "{ty} missing from vectors");
        assert!(v["headers"].get(ty.name()).is_some(), "{ty} has no layout");
    }
    // Retired and never-sent ids are known but absent from the vectors.
    for id in [1u8, 2, 6, 131, 142, 143, 144, 147] {
        assert!(!PacketType::try_from(id).unwrap().is_decodable(), "{id}");
    }
    assert_eq!(PacketType::ALL.len(), 44);
}

#[test]
fn vectors_flag_values() {
    let v = vectors();
    let flags = v["req_flags"].as_object().unwrap();
    let ours = [
        ("RAW_ADDR_HDR", req_flags::RAW_ADDR_HDR),
        ("CQ_DATA_HDR", req_flags::CQ_DATA_HDR),
        ("MSG", req_flags::MSG),
        ("TAGGED", req_flags::TAGGED),
        ("RMA", req_flags::RMA),
        ("ATOMIC", req_flags::ATOMIC),
        ("READ_NACK", req_flags::READ_NACK),
        ("CONNID_HDR", req_flags::CONNID_HDR),
    ];
    assert_eq!(flags.len(), ours.len());
    for (name, val) in ours {
        assert_eq!(flags[name], u64::from(val), "{name}");
    }
    assert_eq!(CONNID_HDR, 0x8000);
    assert_eq!(
        v["headers"]["CTS"]["flags"]["READ_REQ"],
        u64::from(CTS_READ_REQ)
    );
    let rk = &v["headers"]["PEER_ERROR"]["ref_kind"];
    assert_eq!(rk["OPE_INDEX"], u64::from(peer_error_ref::OPE_INDEX));
    assert_eq!(rk["MSG_ID"], u64::from(peer_error_ref::MSG_ID));
    assert_eq!(rk["MSG_ID_SKIP"], u64::from(peer_error_ref::MSG_ID_SKIP));
}

#[test]
fn vectors_handshake_feature_bits() {
    let v = vectors();
    let bits = v["handshake_extra_feature_bits"].as_object().unwrap();
    let ours = [
        ("RDMA_READ", ExtraFeature::RdmaRead),
        ("DELIVERY_COMPLETE", ExtraFeature::DeliveryComplete),
        (
            "REQUEST_CONSTANT_HEADER_LENGTH",
            ExtraFeature::RequestConstantHeaderLength,
        ),
        ("REQUEST_CONNID_HEADER", ExtraFeature::RequestConnidHeader),
        ("RUNT", ExtraFeature::Runt),
        ("RDMA_WRITE", ExtraFeature::RdmaWrite),
        ("READ_NACK", ExtraFeature::ReadNack),
        (
            "REQUEST_USER_RECV_QP_legacy",
            ExtraFeature::RequestUserRecvQp,
        ),
        ("UNSOLICITED_WRITE_RECV", ExtraFeature::UnsolicitedWriteRecv),
        ("PEER_ERROR", ExtraFeature::PeerError),
    ];
    assert_eq!(bits.len(), ours.len());
    assert_eq!(ExtraFeature::ALL.len(), ours.len());
    assert_eq!(
        ExtraFeature::ALL.len() as u32,
        wire::NUM_EXTRA_FEATURE_OR_REQUEST
    );
    for (name, f) in ours {
        assert_eq!(bits[name], u64::from(f.bit()), "{name}");
        assert_eq!(ExtraFeature::from_bit(f.bit()), Some(f));
        // Our names end with the vectors' name (minus the legacy marker).
        let stem = name.strip_suffix("_legacy").unwrap_or(name);
        assert!(f.name().ends_with(stem), "{} vs {name}", f.name());
    }
}

#[test]
fn vectors_every_header_layout() {
    let v = vectors();
    assert_eq!(v["base_header"]["size"], wire::BASE_HDR_LEN as u64);
    let base = fields(&v["base_header"]["fields"]);
    assert_eq!(v["rma_iov"]["size"], wire::RMA_IOV_LEN as u64);

    let headers = v["headers"].as_object().unwrap();
    for (name, h) in headers {
        let ty = PacketType::ALL
            .iter()
            .copied()
            .find(|t| t.name() == name)
            .unwrap_or_else(|| panic!("no packet type {name}"));
        let size = h["size"].as_u64().unwrap() as usize;
        assert_eq!(ty.base_hdr_len(), Some(size), "{name} size");

        let layout = match h.get("same_as") {
            Some(other) => &headers[other.as_str().unwrap()],
            None => h,
        };
        let pkt = sample(ty);
        assert_eq!(pkt.packet_type(), ty);
        let mut buf = BytesMut::new();
        let hdr_len = pkt.encode_header(&mut buf).unwrap();
        assert_eq!(hdr_len, buf.len());
        assert_eq!(hdr_len, pkt.header_len(), "{name}");

        let mut checked = vec![false; size];
        for (field, off, len) in base.iter().chain(fields(&layout["fields"]).iter()) {
            let want = field_value(field, ty, &pkt)
                .unwrap_or_else(|| panic!("{name}: no value for field {field}"));
            let want = &want.to_le_bytes()[..*len];
            assert_eq!(&buf[*off..off + len], want, "{name}.{field} @{off}:{len}");
            for c in &mut checked[*off..off + len] {
                assert!(!*c, "{name}: field {field} overlaps another");
                *c = true;
            }
        }
        assert!(
            checked.iter().all(|c| *c),
            "{name}: the vectors' fields do not cover the {size}-byte header"
        );

        // What follows the fixed header.
        let rest = &buf[size..];
        if ty.has_rma_iov() {
            assert_eq!(
                &rest[..RMA.len() * 24],
                &iov_bytes(&RMA)[..],
                "{name} rma_iov"
            );
            assert!(
                layout["then"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("at {size}")),
                "{name}: rma_iov offset"
            );
        }
        if ty.has_read_iov() {
            // No optional header in the sample: read_iov right after the (iov-extended) header.
            let off = if ty.has_rma_iov() { RMA.len() * 24 } else { 0 };
            assert_eq!(&rest[off..], &iov_bytes(&READ)[..], "{name} read_iov");
        }
        match ty {
            PacketType::CtsData => assert_eq!(rest, &[0x44, 0x43, 0x42, 0x41, 0, 0, 0, 0]),
            PacketType::Handshake => assert_eq!(rest, &0x0807_0605_0403_0201u64.to_le_bytes()),
            _ if !ty.has_rma_iov() && !ty.has_read_iov() => assert!(rest.is_empty(), "{name}"),
            _ => {}
        }

        // The sample decodes back to itself (data-bearing non-REQ packets need their data).
        let payload = match pkt {
            Packet::CtsData { .. } | Packet::ReadRsp { .. } | Packet::AtomRsp { .. } => None,
            _ => Some(&[0u8; 0][..]),
        };
        if let Some(payload) = payload {
            let (back, data) = decode(&buf).unwrap();
            assert_eq!(back, pkt, "{name}");
            assert_eq!(data, payload);
        } else {
            assert_eq!(decode(&buf), Err(WireError::Truncated), "{name}");
        }
    }
}

#[test]
fn vectors_optional_headers_and_raw_address() {
    let v = vectors();
    let opt = &v["optional_headers"];
    assert_eq!(opt["raw_address"]["size"], wire::RAW_ADDR_HDR_LEN as u64);
    assert_eq!(opt["cq_data"]["size"], wire::CQ_DATA_HDR_LEN as u64);
    assert_eq!(opt["connid"]["size"], wire::CONNID_HDR_LEN as u64);
    assert_eq!(v["raw_address"]["size"], efa::RAW_ADDR_LEN as u64);

    let addr = RawAddr::new(
        Gid([0xfe, 0x80, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]),
        0xBEEF,
        0x1357_9BDF,
    );
    let pkt = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::RawAddr(addr),
            cq_data: Some(0xCAFE_F00D_DEAD_BEEF),
        },
        msg_id: MSG_ID,
        tag: None,
        dc_send_id: None,
    };
    let buf = pkt.to_vec(b"xyz").unwrap();
    // 8 mandatory + 40 raw address + 8 CQ data, then data.
    assert_eq!(pkt.header_len(), 56);
    assert_eq!(buf.len(), 56 + 3);
    assert_eq!(
        u16::from_le_bytes([buf[2], buf[3]]),
        req_flags::RAW_ADDR_HDR | req_flags::CQ_DATA_HDR | req_flags::MSG
    );
    let raw_hdr = &buf[8..48];
    let raw_field = |name: &str| {
        let f = fields(&opt["raw_address"]["fields"]);
        let (_, o, l) = f.into_iter().find(|f| f.0 == name).unwrap();
        &raw_hdr[o..o + l]
    };
    assert_eq!(raw_field("addr_len"), &36u32.to_le_bytes());
    assert_eq!(raw_field("pad"), &[0; 4]);
    let raw = raw_field("raw_addr");
    let raw_field_in = |name: &str| {
        let f = fields(&v["raw_address"]["fields"]);
        let (_, o, l) = f.into_iter().find(|f| f.0 == name).unwrap();
        &raw[o..o + l]
    };
    assert_eq!(raw_field_in("gid"), &addr.gid.0);
    assert_eq!(raw_field_in("qpn"), &0xBEEFu16.to_le_bytes());
    assert_eq!(raw_field_in("pad"), &[0; 2]);
    assert_eq!(raw_field_in("qkey_connid"), &0x1357_9BDFu32.to_le_bytes());
    assert_eq!(raw_field_in("reserved"), &[0; 8]);
    assert_eq!(&buf[48..56], &0xCAFE_F00D_DEAD_BEEFu64.to_le_bytes());
    assert_eq!(&buf[56..], b"xyz");
    let (back, data) = decode(&buf).unwrap();
    assert_eq!(back, pkt);
    assert_eq!(back.connid(), Some(0x1357_9BDF));
    assert_eq!(data, b"xyz");

    // After the handshake: CQ data then connid (flag-bit order), 4 bytes, unaligned data after.
    let pkt = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::Connid(CONNID),
            cq_data: Some(7),
        },
        msg_id: MSG_ID,
        tag: Some(TAG),
        dc_send_id: None,
    };
    let buf = pkt.to_vec(b"d").unwrap();
    assert_eq!(buf.len(), 16 + 8 + 4 + 1);
    assert_eq!(&buf[16..24], &7u64.to_le_bytes());
    assert_eq!(&buf[24..28], &CONNID.to_le_bytes());
    assert_eq!(buf[28], b'd');
    assert_eq!(
        u16::from_le_bytes([buf[2], buf[3]]),
        CONNID_HDR | req_flags::CQ_DATA_HDR | req_flags::MSG | req_flags::TAGGED
    );

    // RTW: rma_iov, then the optional headers, then data.
    let pkt = Packet::EagerRtw {
        opt: ReqOpt {
            sender: Sender::Connid(CONNID),
            cq_data: None,
        },
        dc_send_id: None,
        rma_iov: IovList::new(&RMA[..1]),
    };
    let buf = pkt.to_vec(b"w").unwrap();
    assert_eq!(&buf[4..8], &1u32.to_le_bytes());
    assert_eq!(&buf[8..32], &iov_bytes(&RMA[..1])[..]);
    assert_eq!(&buf[32..36], &CONNID.to_le_bytes());
    assert_eq!(&buf[36..], b"w");

    // LONGREAD: optional headers, then read_iov, then (nothing).
    let pkt = Packet::LongReadRtm {
        opt: ReqOpt {
            sender: Sender::Connid(CONNID),
            cq_data: None,
        },
        msg_id: 1,
        msg_length: 1 << 20,
        send_id: 2,
        tag: None,
        read_iov: IovList::new(&READ),
    };
    let buf = pkt.to_vec(&[]).unwrap();
    assert_eq!(&buf[24..28], &CONNID.to_le_bytes());
    assert_eq!(&buf[28..], &iov_bytes(&READ)[..]);
}

#[test]
fn vectors_handshake_as_libfabric_sends_it() {
    let v = vectors();
    let h = &v["headers"]["HANDSHAKE"];
    assert_eq!(h["size"], 8);
    let then = h["then"].as_str().unwrap();
    // The documented field order.
    let order = [
        "connid",
        "host_id",
        "device_version",
        "user_recv_qp",
        "hmem_p2p",
    ];
    let pos: Vec<usize> = order.iter().map(|n| then.find(n).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{then}");

    let features = [
        ExtraFeature::DeliveryComplete,
        ExtraFeature::RequestConnidHeader,
        ExtraFeature::Runt,
        ExtraFeature::ReadNack,
        ExtraFeature::PeerError,
    ];
    let mut hs = Handshake {
        extra_info: ExtraInfo::with_features(&features),
        connid: Some(CONNID),
        host_id: None,
        device_version: Some(0xEFA1),
        user_recv_qp: None,
        p2p: Some(true),
    };
    let mut expect = vec![9u8, 4];
    expect.extend_from_slice(
        &(CONNID_HDR | handshake_flags::DEVICE_VERSION | handshake_flags::HMEM_P2P).to_le_bytes(),
    );
    expect.extend_from_slice(&4u32.to_le_bytes());
    expect.extend_from_slice(&0b10_0101_1010u64.to_le_bytes());
    expect.extend_from_slice(&CONNID.to_le_bytes());
    expect.extend_from_slice(&[0; 4]);
    expect.extend_from_slice(&0xEFA1u32.to_le_bytes());
    expect.extend_from_slice(&[0; 4]);
    expect.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
    let buf = Packet::Handshake(hs).to_vec(&[]).unwrap();
    assert_eq!(buf, expect);
    assert_eq!(buf.len(), 40, "current libfabric handshake is 40 bytes");

    hs.host_id = Some(0x0123_4567_89ab_cdef);
    let buf = Packet::Handshake(hs).to_vec(&[]).unwrap();
    assert_eq!(buf.len(), 48, "48 with host id");
    assert_eq!(&buf[24..32], &0x0123_4567_89ab_cdefu64.to_le_bytes());
    assert_eq!(&buf[32..36], &0xEFA1u32.to_le_bytes());

    hs.user_recv_qp = Some((0x11, 0x22));
    let buf = Packet::Handshake(hs).to_vec(&[]).unwrap();
    assert_eq!(&buf[40..48], &[0x11, 0, 0, 0, 0x22, 0, 0, 0]);
    assert_eq!(&buf[48..56], &[1, 0, 0, 0, 0, 0, 0, 0]);
    let (back, _) = decode(&buf).unwrap();
    let Packet::Handshake(back) = back else {
        panic!()
    };
    assert_eq!(back, hs);
    for f in features {
        assert!(back.extra_info.has(f));
    }
    assert!(!back.extra_info.has(ExtraFeature::RdmaRead));
}

#[test]
fn max_req_header_len_matches_reference() {
    assert_eq!(MAX_REQ_HEADER_LEN, 168);
    let all = req_flags::RAW_ADDR_HDR | req_flags::CQ_DATA_HDR;
    let max = PacketType::ALL
        .iter()
        .filter_map(|t| req_header_len(*t, all, IOV_LIMIT))
        .max();
    assert_eq!(max, Some(MAX_REQ_HEADER_LEN));
    // The reference's examples: EAGER_MSGRTM 8, +4 connid, +40 raw addr, +8 CQ data.
    let t = PacketType::EagerMsgRtm;
    assert_eq!(req_header_len(t, 0, 0), Some(8));
    assert_eq!(req_header_len(t, CONNID_HDR, 0), Some(12));
    assert_eq!(req_header_len(t, req_flags::RAW_ADDR_HDR, 0), Some(48));
    assert_eq!(
        req_header_len(t, CONNID_HDR | req_flags::CQ_DATA_HDR, 0),
        Some(20)
    );
    // Raw address wins over connid, as in libfabric.
    assert_eq!(
        req_header_len(t, CONNID_HDR | req_flags::RAW_ADDR_HDR, 0),
        Some(48)
    );
    // rma_iov only counts for RTW/RTR/RTA.
    assert_eq!(req_header_len(t, 0, 4), Some(8));
    assert_eq!(req_header_len(PacketType::EagerRtw, 0, 4), Some(8 + 96));
    assert_eq!(req_header_len(PacketType::Cts, 0, 0), None);
    assert_eq!(req_header_len(PacketType::ReadRtr, 0, 0), None);
    assert_eq!(
        wire::max_req_data_capacity(8760, t, CONNID_HDR, 0),
        Some(8748)
    );
    assert_eq!(
        wire::max_req_data_capacity(40, t, req_flags::RAW_ADDR_HDR, 0),
        None
    );
    assert_eq!(wire::CTSDATA_MAX_HEADER_LEN, 32);
}

// ---------------------------------------------------------------------------------------------
// 2. Round trips

/// Builds variant `kind` (0..=19) from generated values.
#[allow(clippy::too_many_arguments)]
fn build<'a>(
    kind: u8,
    u: [u32; 5],
    x: [u64; 4],
    b: [bool; 3],
    opt: ReqOpt,
    connid: Option<u32>,
    rma: &'a [RemoteIov],
    read: &'a [RemoteIov],
    hs: Handshake,
    payload_len: usize,
) -> Packet<'a> {
    let tag = b[0].then_some(x[3]);
    let dc = b[1];
    let dc_send_id = dc.then_some(u[3]);
    let rma_iov = IovList::new(rma);
    let read_iov = IovList::new(read);
    match kind {
        0 => Packet::EagerRtm {
            opt,
            msg_id: u[0],
            tag,
            dc_send_id,
        },
        1 => Packet::MediumRtm {
            opt,
            msg_id: u[0],
            msg_length: x[0],
            seg_offset: x[1],
            tag,
            dc_send_id,
        },
        2 => Packet::LongCtsRtm {
            opt,
            msg_id: u[0],
            msg_length: x[0],
            send_id: u[1],
            credit_request: u[2],
            tag,
            dc,
            read_nack: b[2],
        },
        3 => Packet::LongReadRtm {
            opt,
            msg_id: u[0],
            msg_length: x[0],
            send_id: u[1],
            tag,
            read_iov,
        },
        4 => Packet::RuntReadRtm {
            opt,
            msg_id: u[0],
            msg_length: x[0],
            send_id: u[1],
            seg_offset: x[1],
            runt_length: x[2],
            tag,
            read_iov,
        },
        5 => Packet::EagerRtw {
            opt,
            dc_send_id,
            rma_iov,
        },
        6 => Packet::LongCtsRtw {
            opt,
            msg_length: x[0],
            send_id: u[1],
            credit_request: u[2],
            dc,
            read_nack: b[2],
            rma_iov,
        },
        7 => Packet::LongReadRtw {
            opt,
            msg_length: x[0],
            send_id: u[1],
            rma_iov,
            read_iov,
        },
        8 => Packet::ShortRtr {
            opt,
            msg_length: x[0],
            recv_id: u[1],
            rma_iov,
        },
        9 => Packet::LongCtsRtr {
            opt,
            msg_length: x[0],
            recv_id: u[1],
            recv_length: u[2],
            rma_iov,
        },
        10 => Packet::Rta {
            opt,
            kind: match u[4] % 4 {
                0 => RtaKind::Write,
                1 => RtaKind::DcWrite { send_id: u[3] },
                2 => RtaKind::Fetch { recv_id: u[3] },
                _ => RtaKind::Compare { recv_id: u[3] },
            },
            msg_id: u[0],
            atomic_datatype: u[1],
            atomic_op: u[2],
            rma_iov,
        },
        11 => Packet::Cts {
            connid,
            send_id: u[0],
            recv_id: u[1],
            recv_length: x[0],
            read_req: b[2],
        },
        12 => Packet::CtsData {
            connid,
            recv_id: u[0],
            seg_length: payload_len as u64,
            seg_offset: x[1],
        },
        13 => Packet::ReadRsp {
            connid,
            recv_id: u[0],
            send_id: u[1],
            seg_length: payload_len as u64,
        },
        14 => Packet::Eor {
            connid,
            send_id: u[0],
            recv_id: u[1],
        },
        15 => Packet::AtomRsp {
            connid,
            recv_id: u[0],
            seg_length: payload_len as u64,
        },
        16 => Packet::Handshake(hs),
        17 => Packet::Receipt {
            connid,
            send_id: u[0],
            msg_id: u[1],
        },
        18 => Packet::ReadNack {
            connid,
            send_id: u[0],
            recv_id: u[1],
        },
        _ => Packet::PeerError {
            connid,
            op_id: u[0],
            ref_kind: u[1],
            prov_errno: u[2],
        },
    }
}

const KINDS: u8 = 20;

fn check_round_trip(pkt: &Packet<'_>, payload: &[u8]) {
    let mut buf = BytesMut::new();
    let hdr_len = pkt.encode(payload, &mut buf).unwrap();
    assert_eq!(hdr_len, pkt.header_len());
    assert_eq!(buf.len(), hdr_len + payload.len());
    assert_eq!(buf[0], pkt.packet_type().id());
    assert_eq!(buf[1], 4);
    assert_eq!(u16::from_le_bytes([buf[2], buf[3]]), pkt.flags());
    let ty = pkt.packet_type();
    assert!(ty.is_decodable());
    if ty.is_req() {
        let libfabric = req_header_len(ty, pkt.flags(), pkt.rma_iov().len()).unwrap();
        assert_eq!(hdr_len, libfabric + 24 * pkt.read_iov().len());
    }
    let (back, data) = decode(&buf).unwrap_or_else(|e| panic!("{pkt:?}: {e}"));
    assert_eq!(&back, pkt);
    assert_eq!(data, payload);
    // Decoding is allocation-free: the data is a subslice of the input.
    assert_eq!(data.as_ptr(), buf[hdr_len..].as_ptr());
    // Header-only encoding writes the same prefix.
    let mut hdr = Vec::new();
    assert_eq!(pkt.encode_header(&mut hdr).unwrap(), hdr_len);
    assert_eq!(&hdr[..], &buf[..hdr_len]);
}

#[test]
fn round_trip_every_variant_and_optional_header() {
    let addr = RawAddr::new(Gid([7; 16]), 99, 0x7777);
    let senders = [Sender::None, Sender::RawAddr(addr), Sender::Connid(5)];
    let hs = Handshake {
        extra_info: ExtraInfo::with_features(&[ExtraFeature::Runt]),
        connid: Some(3),
        host_id: Some(4),
        device_version: Some(0xEFA0),
        user_recv_qp: Some((1, 2)),
        p2p: Some(false),
    };
    let payload = b"payload bytes";
    let mut n = 0;
    let mut seen = std::collections::HashSet::new();
    for kind in 0..KINDS {
        for sender in senders {
            for cq_data in [None, Some(0xC0DA)] {
                for flags in 0..8u8 {
                    let b = [flags & 1 != 0, flags & 2 != 0, flags & 4 != 0];
                    for connid in [None, Some(0xAB)] {
                        let opt = ReqOpt { sender, cq_data };
                        let pkt = build(
                            kind,
                            [1, 2, 3, 4, u32::from(flags)],
                            [10, 20, 30, 40],
                            b,
                            opt,
                            connid,
                            &RMA[..usize::from(flags) % 4],
                            &READ[..usize::from(flags) % 3],
                            hs,
                            payload.len(),
                        );
                        check_round_trip(&pkt, payload);
                        seen.insert(pkt.packet_type());
                        n += 1;
                    }
                }
            }
        }
    }
    assert_eq!(n, usize::from(KINDS) * 3 * 2 * 8 * 2);
    // Every packet type that is sent on the wire was produced.
    for ty in PacketType::ALL.iter().filter(|t| t.is_decodable()) {
        assert!(seen.contains(ty), "{ty} not exercised");
    }
    assert_eq!(seen.len(), 36);
}

fn arb_iov() -> impl Strategy<Value = RemoteIov> {
    any::<(u64, u64, u64)>().prop_map(|(addr, len, key)| RemoteIov { addr, len, key })
}

fn arb_sender() -> impl Strategy<Value = Sender> {
    prop_oneof![
        Just(Sender::None),
        any::<u32>().prop_map(Sender::Connid),
        any::<([u8; 16], u16, u32)>().prop_map(|(g, q, k)| Sender::RawAddr(RawAddr::new(
            Gid(g),
            q,
            k
        ))),
    ]
}

fn arb_handshake() -> impl Strategy<Value = Handshake> {
    (
        prop::collection::vec(any::<u64>(), 0..=4),
        any::<Option<u32>>(),
        any::<Option<u64>>(),
        any::<Option<u32>>(),
        any::<Option<(u32, u32)>>(),
        any::<Option<bool>>(),
    )
        .prop_map(
            |(w, connid, host_id, device_version, user_recv_qp, p2p)| Handshake {
                extra_info: ExtraInfo::from_words(&w),
                connid,
                host_id,
                device_version,
                user_recv_qp,
                p2p,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_random_fields(
        kind in 0..KINDS,
        u in any::<[u32; 5]>(),
        x in any::<[u64; 4]>(),
        b in any::<[bool; 3]>(),
        sender in arb_sender(),
        cq_data in any::<Option<u64>>(),
        connid in any::<Option<u32>>(),
        rma in prop::collection::vec(arb_iov(), 0..=IOV_LIMIT),
        read in prop::collection::vec(arb_iov(), 0..=IOV_LIMIT),
        hs in arb_handshake(),
        payload in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let opt = ReqOpt { sender, cq_data };
        let pkt = build(kind, u, x, b, opt, connid, &rma, &read, hs, payload.len());
        check_round_trip(&pkt, &payload);
    }

    #[test]
    fn decode_random_bytes_is_total(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn decode_random_bytes_after_a_valid_base_header(
        ty in prop::sample::select(PacketType::ALL),
        flags in any::<u16>(),
        body in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut bytes = vec![ty.id(), 4];
        bytes.extend_from_slice(&flags.to_le_bytes());
        bytes.extend_from_slice(&body);
        check_decode_consistent(&bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Totality

/// `decode` returns; when it accepts, re-encoding what it read decodes to the same thing.
fn check_decode_consistent(bytes: &[u8]) {
    if let Ok((pkt, data)) = decode(bytes) {
        // The data is a suffix window of the input.
        let start = data.as_ptr() as usize - bytes.as_ptr() as usize;
        assert!(start + data.len() <= bytes.len());
        let again = pkt.to_vec(data).expect("a decoded packet re-encodes");
        let (pkt2, data2) = decode(&again).expect("a re-encoded packet decodes");
        assert_eq!(pkt2, pkt);
        assert_eq!(data2, data);
    }
}

fn random_packet_bytes(rng: &mut Rng) -> Vec<u8> {
    let r32 = |rng: &mut Rng| rng.next_u64() as u32;
    let u = [r32(rng), r32(rng), r32(rng), r32(rng), r32(rng)];
    let x = [
        rng.next_u64(),
        rng.next_u64(),
        rng.next_u64(),
        rng.next_u64(),
    ];
    let b = [rng.chance(0.5), rng.chance(0.5), rng.chance(0.5)];
    let sender = match rng.below(3) {
        0 => Sender::None,
        1 => Sender::Connid(r32(rng)),
        _ => Sender::RawAddr(RawAddr::new(Gid([rng.below(256) as u8; 16]), 1, r32(rng))),
    };
    let opt = ReqOpt {
        sender,
        cq_data: rng.chance(0.5).then(|| rng.next_u64()),
    };
    let iov = |rng: &mut Rng| RemoteIov {
        addr: rng.next_u64(),
        len: rng.next_u64(),
        key: rng.next_u64(),
    };
    let rma: Vec<RemoteIov> = (0..rng.below(5)).map(|_| iov(rng)).collect();
    let read: Vec<RemoteIov> = (0..rng.below(5)).map(|_| iov(rng)).collect();
    let words: Vec<u64> = (0..rng.below(5)).map(|_| rng.next_u64()).collect();
    let hs = Handshake {
        extra_info: ExtraInfo::from_words(&words),
        connid: rng.chance(0.5).then(|| r32(rng)),
        host_id: rng.chance(0.5).then(|| rng.next_u64()),
        device_version: rng.chance(0.5).then(|| r32(rng)),
        user_recv_qp: rng.chance(0.5).then(|| (r32(rng), r32(rng))),
        p2p: rng.chance(0.5).then(|| rng.chance(0.5)),
    };
    let payload: Vec<u8> = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
    let connid = rng.chance(0.5).then(|| r32(rng));
    let kind = rng.below(u64::from(KINDS)) as u8;
    let pkt = build(kind, u, x, b, opt, connid, &rma, &read, hs, payload.len());
    pkt.to_vec(&payload).unwrap()
}

fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        match rng.below(6) {
            // Flip a byte.
            0 if !bytes.is_empty() => {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] ^= 1 << rng.below(8);
            }
            // Truncate.
            1 => {
                let n = rng.below(bytes.len() as u64 + 1) as usize;
                bytes.truncate(n);
            }
            // Extend with random bytes.
            2 => {
                for _ in 0..rng.below(48) {
                    bytes.push(rng.next_u64() as u8);
                }
            }
            // Overwrite an aligned u32 with an extreme value (counts, lengths, addr_len...).
            3 if bytes.len() >= 8 => {
                let i = 4 * rng.below(bytes.len() as u64 / 4) as usize;
                let v = [u32::MAX, 0, 1, 3, 4, 5, 36, 31, 0x8000_0000][rng.below(9) as usize];
                bytes[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            // Random flags.
            4 if bytes.len() >= 4 => {
                let f = rng.next_u64() as u16;
                bytes[2..4].copy_from_slice(&f.to_le_bytes());
            }
            // Random type id.
            _ if !bytes.is_empty() => {
                bytes[0] = rng.next_u64() as u8;
            }
            _ => {}
        }
    }
}

#[test]
fn decode_never_panics_seeded() {
    let seed = test_seed();
    eprintln!("decode_never_panics_seeded: EFA_TEST_SEED={seed}");
    let mut rng = Rng::new(seed);
    let mut ok = 0usize;
    for i in 0..120_000 {
        let bytes = if i % 3 == 0 {
            // Pure noise, half of it with a valid version byte.
            let n = rng.below(300) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            if rng.chance(0.5) && b.len() > 1 {
                b[1] = 4;
            }
            b
        } else {
            let mut b = random_packet_bytes(&mut rng);
            if i % 3 == 1 {
                check_decode_consistent(&b);
                assert!(
                    decode(&b).is_ok(),
                    "seed {seed}, case {i}: valid packet refused"
                );
            }
            mutate(&mut rng, &mut b);
            b
        };
        if decode(&bytes).is_ok() {
            ok += 1;
        }
        check_decode_consistent(&bytes);
    }
    eprintln!("decoded {ok} of 120000");
    // The mutations leave a good share of packets decodable, so the deep paths are exercised.
    assert!(ok > 20_000, "seed {seed}: only {ok} decoded");
}

// ---------------------------------------------------------------------------------------------
// 4. Specific errors

fn hdr(ty: u8, version: u8, flags: u16) -> Vec<u8> {
    let mut b = vec![ty, version];
    b.extend_from_slice(&flags.to_le_bytes());
    b
}

#[test]
fn errors_base_header() {
    assert_eq!(decode(&[]), Err(WireError::Truncated));
    assert_eq!(decode(&[64]), Err(WireError::Truncated));
    assert_eq!(decode(&[64, 4, 0]), Err(WireError::Truncated));
    // Complete base header, incomplete mandatory header.
    assert_eq!(decode(&hdr(64, 4, 0)), Err(WireError::Truncated));
    assert_eq!(decode(&hdr(3, 4, 0)), Err(WireError::Truncated));

    let mut p = Packet::Eor {
        connid: None,
        send_id: 1,
        recv_id: 2,
    }
    .to_vec(&[])
    .unwrap();
    for v in [0u8, 3, 5, 255] {
        p[1] = v;
        assert_eq!(decode(&p), Err(WireError::BadVersion(v)));
    }
    p[1] = 4;
    for t in [0u8, 13, 63, 77, 127, 132, 148, 200, 255] {
        p[0] = t;
        assert_eq!(decode(&p), Err(WireError::UnknownType(t)), "type {t}");
        assert_eq!(PacketType::try_from(t), Err(WireError::UnknownType(t)));
    }
    for (t, ty) in [
        (1u8, PacketType::RetiredRts),
        (2, PacketType::RetiredConnack),
        (6, PacketType::RmaContext),
        (131, PacketType::ReadRtr),
        (142, PacketType::RuntCtsMsgRtm),
        (143, PacketType::RuntCtsTagRtm),
        (144, PacketType::RuntCtsRtw),
        (147, PacketType::RuntReadRtw),
    ] {
        p[0] = t;
        assert_eq!(decode(&p), Err(WireError::NotDecodable(ty)), "type {t}");
    }

    let e: efa::Error = WireError::BadVersion(3).into();
    assert_eq!(e.kind(), efa::ErrorKind::InvalidArgument);
    assert_eq!(e.op(), "decode");
    assert!(e.to_string().contains("version 3"), "{e}");
}

#[test]
fn errors_iov_counts() {
    // EAGER_RTW with rma_iov_count = u32::MAX and nothing after: refused without allocating.
    let mut b = hdr(70, 4, 0);
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&b), Err(WireError::BadField("rma_iov_count")));
    // Five entries present, still above the limit.
    let mut b = hdr(70, 4, 0);
    b.extend_from_slice(&5u32.to_le_bytes());
    b.extend_from_slice(&[0; 5 * 24]);
    assert_eq!(decode(&b), Err(WireError::BadField("rma_iov_count")));
    // Four announced, three present.
    let mut b = hdr(70, 4, 0);
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&[0; 3 * 24]);
    assert_eq!(decode(&b), Err(WireError::Truncated));
    // The u32::MAX count sits at offset 8 in RTA headers.
    let mut b = Packet::Rta {
        opt: ReqOpt::default(),
        kind: RtaKind::Fetch { recv_id: 1 },
        msg_id: 0,
        atomic_datatype: 0,
        atomic_op: 0,
        rma_iov: IovList::new(&RMA),
    }
    .to_vec(&[])
    .unwrap();
    b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&b), Err(WireError::BadField("rma_iov_count")));
    // read_iov_count = u32::MAX in LONGREAD_MSGRTM.
    let mut b = sample(PacketType::LongReadMsgRtm).to_vec(&[]).unwrap();
    b[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&b), Err(WireError::BadField("read_iov_count")));

    // The encoder refuses more than IOV_LIMIT entries and writes nothing.
    let five = [RMA[0]; 5];
    let pkt = Packet::EagerRtw {
        opt: ReqOpt::default(),
        dc_send_id: None,
        rma_iov: IovList::new(&five),
    };
    let mut out = BytesMut::new();
    assert_eq!(
        pkt.encode_header(&mut out),
        Err(WireError::BadField("rma_iov_count"))
    );
    assert!(out.is_empty());
    // ... and a fixed buffer too small for the header.
    let mut small = [0u8; 10];
    let pkt = sample(PacketType::MediumTagRtm);
    assert!(matches!(
        pkt.encode_header(&mut &mut small[..]),
        Err(WireError::BadField(_))
    ));
    let mut exact = [0u8; 32];
    assert_eq!(pkt.encode_header(&mut &mut exact[..]), Ok(32));
}

#[test]
fn errors_raw_address_header() {
    let raw = RawAddr::new(Gid([1; 16]), 2, 3);
    let pkt = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::RawAddr(raw),
            cq_data: Some(9),
        },
        msg_id: 1,
        tag: None,
        dc_send_id: None,
    };
    let good = pkt.to_vec(b"data").unwrap();
    let with_addr_len = |n: u32| {
        let mut b = good.clone();
        b[8..12].copy_from_slice(&n.to_le_bytes());
        b
    };
    // addr_len larger than the packet.
    assert_eq!(decode(&with_addr_len(1000)), Err(WireError::Truncated));
    assert_eq!(decode(&with_addr_len(u32::MAX)), Err(WireError::Truncated));
    // addr_len smaller than a raw address.
    assert_eq!(
        decode(&with_addr_len(31)),
        Err(WireError::BadField("addr_len"))
    );
    assert_eq!(
        decode(&with_addr_len(0)),
        Err(WireError::BadField("addr_len"))
    );
    // A shorter header from an older provider (addr_len 32): honoured, CQ data read after it.
    let short = with_addr_len(32);
    let (p, data) = decode(&short).unwrap();
    assert_eq!(p.req_opt().unwrap().sender, Sender::RawAddr(raw));
    // CQ data now starts at the 4 pad bytes: its value is shifted.
    assert_eq!(p.req_opt().unwrap().cq_data, Some(9 << 32));
    assert_eq!(data.len(), 4 + 4);
    // A longer one (addr_len 44): the 8 extra bytes are skipped.
    let mut b = pkt.to_vec(b"").unwrap();
    b.splice(48..48, [0xEE; 8]);
    b[8..12].copy_from_slice(&44u32.to_le_bytes());
    let (p2, data) = decode(&b).unwrap();
    assert_eq!(p2, pkt);
    assert!(data.is_empty());
    // Raw address and connid flags together are refused.
    let mut b = good.clone();
    let f = u16::from_le_bytes([b[2], b[3]]) | CONNID_HDR;
    b[2..4].copy_from_slice(&f.to_le_bytes());
    assert_eq!(decode(&b), Err(WireError::BadField("flags")));
}

#[test]
fn errors_lengths_and_handshake() {
    // CTSDATA whose seg_length exceeds the data present.
    let pkt = Packet::CtsData {
        connid: Some(1),
        recv_id: 2,
        seg_length: 5,
        seg_offset: 0,
    };
    let b = pkt.to_vec(b"12345").unwrap();
    assert_eq!(decode(&b).unwrap().1, b"12345");
    assert_eq!(decode(&b[..b.len() - 1]), Err(WireError::Truncated));
    let mut huge = b.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(decode(&huge), Err(WireError::Truncated));
    // Extra trailing bytes are not data.
    let mut longer = b.clone();
    longer.extend_from_slice(b"pad");
    assert_eq!(decode(&longer).unwrap().1, b"12345");
    // The encoder insists on seg_length == payload length.
    assert_eq!(pkt.to_vec(b"1234"), Err(WireError::BadField("seg_length")));
    // Without the connid flag there is no trailer.
    let pkt = Packet::CtsData {
        connid: None,
        recv_id: 2,
        seg_length: 3,
        seg_offset: 0,
    };
    assert_eq!(pkt.to_vec(b"abc").unwrap().len(), 24 + 3);

    // HANDSHAKE nextra_p3 below 3, huge, and with more words than kept.
    let mut b = hdr(9, 4, 0);
    b.extend_from_slice(&2u32.to_le_bytes());
    assert_eq!(decode(&b), Err(WireError::BadField("nextra_p3")));
    let mut b = hdr(9, 4, 0);
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    b.extend_from_slice(&[0xFF; 64]);
    assert_eq!(decode(&b), Err(WireError::Truncated));
    let mut b = hdr(9, 4, CONNID_HDR | handshake_flags::HMEM_P2P);
    b.extend_from_slice(&(6u32 + 3).to_le_bytes());
    for w in 1..=6u64 {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b.extend_from_slice(&[0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0]);
    b.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
    let (p, rest) = decode(&b).unwrap();
    let Packet::Handshake(h) = p else { panic!() };
    assert_eq!(h.extra_info.words(), &[1, 2, 3, 4]);
    assert_eq!(h.connid, Some(0x1234_5678));
    assert_eq!(h.p2p, Some(false));
    assert_eq!(h.host_id, None);
    assert!(rest.is_empty());
    // nextra_p3 = 3: no extra_info at all (legal).
    let mut b = hdr(9, 4, 0);
    b.extend_from_slice(&3u32.to_le_bytes());
    let (p, _) = decode(&b).unwrap();
    assert_eq!(
        p,
        Packet::Handshake(Handshake {
            extra_info: ExtraInfo::empty(),
            ..Handshake::default()
        })
    );
    // A flagged optional field that is missing.
    let mut b = hdr(9, 4, handshake_flags::HOST_ID);
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&[0; 8 + 7]);
    assert_eq!(decode(&b), Err(WireError::Truncated));
}

#[test]
fn zero_byte_eager_rtw_handshake_trigger() {
    // libfabric's handshake trigger: an EAGER_RTW with no rma_iov and no data.
    let pkt = Packet::EagerRtw {
        opt: ReqOpt {
            sender: Sender::RawAddr(RawAddr::new(Gid([9; 16]), 1, 2)),
            cq_data: None,
        },
        dc_send_id: None,
        rma_iov: IovList::EMPTY,
    };
    let b = pkt.to_vec(&[]).unwrap();
    assert_eq!(b.len(), 8 + 40);
    let (p, data) = decode(&b).unwrap();
    assert_eq!(p, pkt);
    assert!(data.is_empty());
    assert_eq!(p.connid(), Some(2));
    assert_eq!(p.msg_id(), None);
}
