//! HANDSHAKE: extra feature/request bits ([`ExtraFeature`], [`ExtraInfo`]) and the optional
//! fields ([`Handshake`]).

use std::fmt;

use super::{CONNID_HDR, HANDSHAKE_OPT_LEN, MAX_NUM_EXINFO, handshake_flags};

id_enum! {
    /// Handshake extra feature/request bits: bit `i` of `extra_info[i / 64]`.
    pub enum ExtraFeature;
    /// Every bit, in order.
    ALL;
    /// The feature of a bit id.
    fn from_bit(bit: u32);
    /// libfabric's name without the `EFA_RDM_EXTRA_` prefix.
    fn name;

    /// The sender's device can RDMA-read (long-read and runting-read protocols).
    RdmaRead = 0, "FEATURE_RDMA_READ";
    /// Delivery-complete REQ types and RECEIPT (baseline since libfabric 2.6).
    DeliveryComplete = 1, "FEATURE_DELIVERY_COMPLETE";
    /// Request: keep the raw-address header in every REQ (deprecated since 1.22).
    RequestConstantHeaderLength = 2, "REQUEST_CONSTANT_HEADER_LENGTH";
    /// Request: put the connid header in REQ packets (baseline since 2.6).
    RequestConnidHeader = 3, "REQUEST_CONNID_HEADER";
    /// Runting read (baseline since 2.6).
    Runt = 4, "FEATURE_RUNT";
    /// The sender's device can RDMA-write.
    RdmaWrite = 5, "FEATURE_RDMA_WRITE";
    /// READ_NACK fallback (baseline since 2.6).
    ReadNack = 6, "FEATURE_READ_NACK";
    /// Legacy: headerless eager to a user receive QP (never advertised by current libfabric).
    RequestUserRecvQp = 7, "FEATURE_REQUEST_USER_RECV_QP";
    /// RDMA write with immediate data lands without a posted receive.
    UnsolicitedWriteRecv = 8, "FEATURE_UNSOLICITED_WRITE_RECV";
    /// PEER_ERROR packets are understood (2.6+).
    PeerError = 9, "FEATURE_PEER_ERROR";
}

impl ExtraFeature {
    /// The bit id.
    pub const fn bit(self) -> u32 {
        self as u32
    }
}

/// A HANDSHAKE's `extra_info` words: up to [`MAX_NUM_EXINFO`] 64-bit words of feature bits.
///
/// On the wire there are `nextra_p3 - 3` words; current libfabric sends one.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExtraInfo {
    words: [u64; MAX_NUM_EXINFO],
    len: u8,
}

impl ExtraInfo {
    /// One zero word, the shape current libfabric sends (`nextra_p3 = 4`).
    pub const fn new() -> ExtraInfo {
        ExtraInfo {
            words: [0; MAX_NUM_EXINFO],
            len: 1,
        }
    }

    /// No word at all (`nextra_p3 = 3`).
    pub const fn empty() -> ExtraInfo {
        ExtraInfo {
            words: [0; MAX_NUM_EXINFO],
            len: 0,
        }
    }

    /// The given words; words beyond [`MAX_NUM_EXINFO`] are dropped.
    pub fn from_words(words: &[u64]) -> ExtraInfo {
        let mut e = ExtraInfo::empty();
        for (d, s) in e.words.iter_mut().zip(words) {
            *d = *s;
        }
        e.len = words.len().min(MAX_NUM_EXINFO) as u8;
        e
    }

    /// One word with these features set.
    pub fn with_features(features: &[ExtraFeature]) -> ExtraInfo {
        let mut e = ExtraInfo::new();
        for f in features {
            e.set(*f);
        }
        e
    }

    /// The words as sent.
    pub fn words(&self) -> &[u64] {
        self.words.get(..usize::from(self.len)).unwrap_or(&[])
    }

    /// Whether bit `bit` is set (bits past the words sent are clear).
    pub fn has_bit(&self, bit: u32) -> bool {
        self.words()
            .get((bit / 64) as usize)
            .is_some_and(|w| w & (1u64 << (bit % 64)) != 0)
    }

    /// Whether a feature is set.
    pub fn has(&self, f: ExtraFeature) -> bool {
        self.has_bit(f.bit())
    }

    /// Sets bit `bit`, adding words as needed; bits beyond `64 * MAX_NUM_EXINFO` are ignored.
    pub fn set_bit(&mut self, bit: u32) {
        let i = (bit / 64) as usize;
        if let Some(w) = self.words.get_mut(i) {
            *w |= 1u64 << (bit % 64);
            self.len = self.len.max(i as u8 + 1);
        }
    }

    /// Sets a feature bit.
    pub fn set(&mut self, f: ExtraFeature) {
        self.set_bit(f.bit());
    }

    /// The known features set.
    pub fn features(&self) -> impl Iterator<Item = ExtraFeature> + '_ {
        ExtraFeature::ALL.iter().copied().filter(|f| self.has(*f))
    }
}

impl Default for ExtraInfo {
    fn default() -> Self {
        ExtraInfo::new()
    }
}

impl fmt::Debug for ExtraInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtraInfo")
            .field("words", &self.words())
            .field("features", &self.features().collect::<Vec<_>>())
            .finish()
    }
}

/// A HANDSHAKE packet: the sender's feature bits and its optional fields, each present only when
/// its flag is set. Current libfabric always sends connid, device version and p2p, and the host
/// id when it knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Handshake {
    /// Feature and request bits.
    pub extra_info: ExtraInfo,
    /// The sender's connid (QKEY), flag [`CONNID_HDR`].
    pub connid: Option<u32>,
    /// The sender's host id (EC2 instance id as a number), flag [`handshake_flags::HOST_ID`].
    pub host_id: Option<u64>,
    /// The sender's device version (`vendor_part_id`, e.g. 0xEFA1),
    /// flag [`handshake_flags::DEVICE_VERSION`].
    pub device_version: Option<u32>,
    /// A legacy peer's user receive QP `(qpn, qkey)`, flag [`handshake_flags::USER_RECV_QP`].
    pub user_recv_qp: Option<(u32, u32)>,
    /// Whether the sender supports peer-to-peer device memory, flag [`handshake_flags::HMEM_P2P`].
    pub p2p: Option<bool>,
}

impl Handshake {
    /// The flag bits the present optional fields set.
    pub fn flags(&self) -> u16 {
        let mut f = 0;
        if self.connid.is_some() {
            f |= CONNID_HDR;
        }
        if self.host_id.is_some() {
            f |= handshake_flags::HOST_ID;
        }
        if self.device_version.is_some() {
            f |= handshake_flags::DEVICE_VERSION;
        }
        if self.user_recv_qp.is_some() {
            f |= handshake_flags::USER_RECV_QP;
        }
        if self.p2p.is_some() {
            f |= handshake_flags::HMEM_P2P;
        }
        f
    }

    /// Encoded length: 8 + 8 per `extra_info` word + 8 per optional field.
    pub fn header_len(&self) -> usize {
        let opts = self.flags().count_ones() as usize;
        8 + 8 * self.extra_info.words().len() + HANDSHAKE_OPT_LEN * opts
    }
}
