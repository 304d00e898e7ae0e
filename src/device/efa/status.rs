//! EFA completion statuses and opcodes: from what rdma-core reports to the seam's [`Status`] and
//! [`Opcode`].
//!
//! rdma-core's EFA provider reports each completion twice: as a generic `ibv_wc_status` and, in
//! `vendor_err`, as the device's own `EFA_IO_COMP_STATUS_*` code (0–18). The EFA code is the more
//! precise one (`IBV_WC_RESP_TIMEOUT_ERR` stands for both "unresponsive" and "unreachable"), so it
//! decides; the generic status only decides success and flush.

use rdma_sys::{ibv_wc_opcode, ibv_wc_status};

use crate::device::{Opcode, Status};

/// The seam status of a completion with verbs status `wc_status` and vendor error `vendor_err`.
///
/// * `IBV_WC_SUCCESS` is [`Status::Success`], `IBV_WC_WR_FLUSH_ERR` is [`Status::Flushed`];
/// * any other status is the EFA code in `vendor_err`;
/// * a code this crate does not know (16, 17, ≥ 19), or an error completion whose vendor code
///   claims success, is [`Status::LocalQpInternalError`] — never a panic.
///
/// ```
/// # #[cfg(feature = "efa")] {
/// use efa::device::Status;
/// use efa::device::efa::status_from_wc;
/// assert_eq!(status_from_wc(0, 0), Status::Success);
/// assert_eq!(status_from_wc(12, 10), Status::RnrRetryExceeded);
/// assert_eq!(status_from_wc(21, 17), Status::LocalQpInternalError);
/// # }
/// ```
pub fn status_from_wc(wc_status: u32, vendor_err: u32) -> Status {
    match wc_status {
        ibv_wc_status::IBV_WC_SUCCESS => Status::Success,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => Status::Flushed,
        _ => status_from_vendor_err(vendor_err),
    }
}

/// The seam status of an EFA vendor error code of a failed completion.
pub fn status_from_vendor_err(vendor_err: u32) -> Status {
    match u8::try_from(vendor_err).ok().and_then(Status::from_code) {
        // A failed completion is never a success.
        Some(Status::Success) | None => Status::LocalQpInternalError,
        Some(s) => s,
    }
}

/// The seam opcode of a completion's verbs opcode, or `None` for one this device never posts.
pub fn opcode_from_wc(opcode: u32) -> Option<Opcode> {
    Some(match opcode {
        ibv_wc_opcode::IBV_WC_SEND => Opcode::Send,
        ibv_wc_opcode::IBV_WC_RECV => Opcode::Recv,
        ibv_wc_opcode::IBV_WC_RDMA_READ => Opcode::RdmaRead,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE => Opcode::RdmaWrite,
        ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => Opcode::RecvRdmaWithImm,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// Every EFA code, its status and the error kind an application sees.
    const TABLE: &[(u32, Status, ErrorKind)] = &[
        (1, Status::Flushed, ErrorKind::Canceled),
        (2, Status::LocalQpInternalError, ErrorKind::Io),
        (3, Status::UnsupportedOp, ErrorKind::NotSupported),
        (4, Status::InvalidAh, ErrorKind::InvalidArgument),
        (5, Status::InvalidLkey, ErrorKind::InvalidArgument),
        (6, Status::LocalBadLength, ErrorKind::MsgSize),
        (7, Status::RemoteBadAddress, ErrorKind::RemoteAccess),
        (8, Status::RemoteAbort, ErrorKind::ConnectionAborted),
        (9, Status::BadDestQpn, ErrorKind::NotConnected),
        (10, Status::RnrRetryExceeded, ErrorKind::NoRx),
        (11, Status::RemoteBadLength, ErrorKind::MsgSize),
        (12, Status::RemoteBadStatus, ErrorKind::RemoteIo),
        (13, Status::UnresponsiveRemote, ErrorKind::ConnectionAborted),
        (14, Status::UnknownPeer, ErrorKind::NotConnected),
        (15, Status::UnreachableRemote, ErrorKind::Unreachable),
        // 16 and 17 are not defined by the device.
        (16, Status::LocalQpInternalError, ErrorKind::Io),
        (17, Status::LocalQpInternalError, ErrorKind::Io),
        (18, Status::FeatureMismatch, ErrorKind::NotSupported),
    ];

    /// The generic status rdma-core pairs with each EFA code (`to_ibv_status`).
    fn ibv_status_of(code: u32) -> u32 {
        use ibv_wc_status::*;
        match code {
            0 => IBV_WC_SUCCESS,
            1 => IBV_WC_WR_FLUSH_ERR,
            2..=4 => IBV_WC_LOC_QP_OP_ERR,
            5 => IBV_WC_LOC_PROT_ERR,
            6 => IBV_WC_LOC_LEN_ERR,
            7 => IBV_WC_REM_ACCESS_ERR,
            8 => IBV_WC_REM_ABORT_ERR,
            9 => IBV_WC_REM_INV_RD_REQ_ERR,
            10 => IBV_WC_RNR_RETRY_EXC_ERR,
            11 | 18 => IBV_WC_REM_INV_REQ_ERR,
            12 => IBV_WC_BAD_RESP_ERR,
            13 | 15 => IBV_WC_RESP_TIMEOUT_ERR,
            14 => IBV_WC_REM_OP_ERR,
            _ => IBV_WC_GENERAL_ERR,
        }
    }

    #[test]
    fn every_efa_code_maps() {
        assert_eq!(status_from_wc(ibv_status_of(0), 0), Status::Success);
        for &(code, status, kind) in TABLE {
            let got = status_from_wc(ibv_status_of(code), code);
            assert_eq!(got, status, "EFA code {code}");
            assert_eq!(got.error_kind(), kind, "EFA code {code}");
            assert_eq!(status_from_vendor_err(code), status, "vendor code {code}");
        }
    }

    #[test]
    fn known_codes_round_trip() {
        for &(code, status, _) in TABLE {
            if status != Status::LocalQpInternalError || code == 2 {
                assert_eq!(u32::from(status.code()), code);
            }
        }
    }

    #[test]
    fn unknown_codes_never_panic() {
        for code in [19, 20, 64, 255, 256, 4096, u32::MAX] {
            assert_eq!(
                status_from_wc(ibv_wc_status::IBV_WC_GENERAL_ERR, code),
                Status::LocalQpInternalError
            );
        }
        // An error completion whose vendor code says "OK" is still an error.
        assert_eq!(
            status_from_wc(ibv_wc_status::IBV_WC_GENERAL_ERR, 0),
            Status::LocalQpInternalError
        );
        // Success and flush are decided by the generic status whatever the vendor code says.
        assert_eq!(
            status_from_wc(ibv_wc_status::IBV_WC_SUCCESS, 99),
            Status::Success
        );
        assert_eq!(
            status_from_wc(ibv_wc_status::IBV_WC_WR_FLUSH_ERR, 0),
            Status::Flushed
        );
    }

    #[test]
    fn opcodes() {
        use ibv_wc_opcode::*;
        assert_eq!(opcode_from_wc(IBV_WC_SEND), Some(Opcode::Send));
        assert_eq!(opcode_from_wc(IBV_WC_RECV), Some(Opcode::Recv));
        assert_eq!(opcode_from_wc(IBV_WC_RDMA_READ), Some(Opcode::RdmaRead));
        assert_eq!(opcode_from_wc(IBV_WC_RDMA_WRITE), Some(Opcode::RdmaWrite));
        assert_eq!(
            opcode_from_wc(IBV_WC_RECV_RDMA_WITH_IMM),
            Some(Opcode::RecvRdmaWithImm)
        );
        assert_eq!(opcode_from_wc(IBV_WC_COMP_SWAP), None);
        assert_eq!(opcode_from_wc(12345), None);
    }
}
