//! The control messages two multi-rail groups exchange over their rails' RDM endpoints (plain
//! untagged messages; the bulk of the data moves by RMA writes and reads). Every message starts
//! with `RL`, a version byte, its kind and a 64-bit sequence number; a message that does not
//! parse is dropped and counted, never trusted.

use bytes::{BufMut, Bytes, BytesMut};

use super::addr::RailRemoteKey;

const MAGIC: [u8; 2] = *b"RL";
const VERSION: u8 = 1;
/// Bytes before a message's body.
pub(super) const HEADER_LEN: usize = 12;
/// The longest header of any kind (a [`Ctrl::Cts`] with a key per rail).
pub(super) const MAX_CTRL_LEN: usize = HEADER_LEN + 20 + 8 * super::addr::MAX_RAILS;

/// One control message. `seq` numbers a sender's messages and write notifications to one peer
/// (the receiver delivers them in that order); the others answer or finish the one `seq` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Ctrl {
    /// A whole small message.
    Msg { seq: u64, data: Bytes },
    /// A large message of `len` bytes asks for the receiver's buffer.
    Rts { seq: u64, len: u64 },
    /// The receiver's buffer for message `seq`, registered on every rail (`key.len` bytes are
    /// taken; fewer than the message's is a truncation).
    Cts { seq: u64, key: RailRemoteKey },
    /// Every byte of message `seq` is written (`len`: the message's full length).
    Fin { seq: u64, len: u64 },
    /// A striped write with immediate data: every stripe of its `len` bytes landed.
    Notify { seq: u64, data: u32, len: u64 },
    /// The sender gave message or notification `seq` up.
    Abort { seq: u64 },
    /// The receiver could not take message `seq` (its buffer did not register).
    Refuse { seq: u64 },
    /// The control message of kind `kind` and sequence number `seq` arrived (every kind but
    /// this one is acknowledged, and sent again on another rail until it is).
    Ack { seq: u64, kind: u8 },
}

/// A little-endian u64 at `i` of `b`.
pub(super) fn le64(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(i..i.checked_add(8)?)?.try_into().ok()?,
    ))
}

impl Ctrl {
    /// The kind's number on the wire.
    pub(super) fn kind(&self) -> u8 {
        match self {
            Ctrl::Msg { .. } => 1,
            Ctrl::Rts { .. } => 2,
            Ctrl::Cts { .. } => 3,
            Ctrl::Fin { .. } => 4,
            Ctrl::Notify { .. } => 5,
            Ctrl::Abort { .. } => 6,
            Ctrl::Refuse { .. } => 7,
            Ctrl::Ack { .. } => 8,
        }
    }

    /// The sequence number.
    pub(super) fn seq(&self) -> u64 {
        match self {
            Ctrl::Msg { seq, .. }
            | Ctrl::Rts { seq, .. }
            | Ctrl::Cts { seq, .. }
            | Ctrl::Fin { seq, .. }
            | Ctrl::Notify { seq, .. }
            | Ctrl::Abort { seq }
            | Ctrl::Refuse { seq }
            | Ctrl::Ack { seq, .. } => *seq,
        }
    }

    pub(super) fn encode(&self) -> Bytes {
        let extra = match self {
            Ctrl::Msg { data, .. } => data.len(),
            _ => 0,
        };
        let mut b = BytesMut::with_capacity(MAX_CTRL_LEN + extra);
        b.put_slice(&MAGIC);
        b.put_u8(VERSION);
        b.put_u8(self.kind());
        b.put_u64_le(self.seq());
        match self {
            Ctrl::Msg { data, .. } => b.put_slice(data),
            Ctrl::Rts { len, .. } | Ctrl::Fin { len, .. } => b.put_u64_le(*len),
            Ctrl::Cts { key, .. } => {
                let mut v = Vec::new();
                key.encode(&mut v);
                b.put_slice(&v);
            }
            Ctrl::Notify { data, len, .. } => {
                b.put_u32_le(*data);
                b.put_u64_le(*len);
            }
            Ctrl::Ack { kind, .. } => b.put_u8(*kind),
            Ctrl::Abort { .. } | Ctrl::Refuse { .. } => {}
        }
        b.freeze()
    }

    /// Parses one message; `None` for anything malformed (wrong magic or version, unknown kind,
    /// a body of the wrong length).
    pub(super) fn decode(b: &[u8]) -> Option<Ctrl> {
        if b.len() < HEADER_LEN || b[..2] != MAGIC || b[2] != VERSION {
            return None;
        }
        let seq = le64(b, 4)?;
        let body = &b[HEADER_LEN..];
        let exact = |n: usize| (body.len() == n).then_some(());
        Some(match b[3] {
            1 => Ctrl::Msg {
                seq,
                data: Bytes::copy_from_slice(body),
            },
            2 => {
                exact(8)?;
                Ctrl::Rts {
                    seq,
                    len: le64(body, 0)?,
                }
            }
            3 => match RailRemoteKey::decode(body)? {
                (key, []) => Ctrl::Cts { seq, key },
                _ => return None,
            },
            4 => {
                exact(8)?;
                Ctrl::Fin {
                    seq,
                    len: le64(body, 0)?,
                }
            }
            5 => {
                exact(12)?;
                Ctrl::Notify {
                    seq,
                    data: u32::from_le_bytes(body[..4].try_into().ok()?),
                    len: le64(body, 4)?,
                }
            }
            6 => {
                exact(0)?;
                Ctrl::Abort { seq }
            }
            7 => {
                exact(0)?;
                Ctrl::Refuse { seq }
            }
            8 => {
                exact(1)?;
                Ctrl::Ack { seq, kind: body[0] }
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_and_bad_input_is_refused() {
        let key = RailRemoteKey {
            addr: 1 << 40,
            len: 99,
            keys: vec![1, 2, u64::MAX],
        };
        let all = [
            Ctrl::Msg {
                seq: 1,
                data: Bytes::from_static(b"hello"),
            },
            Ctrl::Msg {
                seq: 2,
                data: Bytes::new(),
            },
            Ctrl::Rts {
                seq: 3,
                len: 1 << 33,
            },
            Ctrl::Cts { seq: 4, key },
            Ctrl::Fin { seq: 5, len: 7 },
            Ctrl::Notify {
                seq: 6,
                data: 0xdead_beef,
                len: 8,
            },
            Ctrl::Abort { seq: u64::MAX },
            Ctrl::Refuse { seq: 0 },
            Ctrl::Ack { seq: 9, kind: 2 },
        ];
        for c in all {
            let b = c.encode();
            assert_eq!(Ctrl::decode(&b), Some(c.clone()));
            // Every shorter prefix but a message's is refused, and so is a longer body.
            if !matches!(c, Ctrl::Msg { .. }) {
                for n in 0..b.len() {
                    assert_eq!(Ctrl::decode(&b[..n]), None, "{c:?} cut at {n}");
                }
                let mut long = b.to_vec();
                long.push(0);
                assert_eq!(Ctrl::decode(&long), None, "{c:?} with a byte more");
            }
        }
        assert_eq!(Ctrl::decode(b"RL\x02\x01\0\0\0\0\0\0\0\0"), None, "version");
        assert_eq!(Ctrl::decode(b"RL\x01\x09\0\0\0\0\0\0\0\0"), None, "kind");
        assert_eq!(Ctrl::decode(b"XX\x01\x01\0\0\0\0\0\0\0\0"), None, "magic");
    }
}
