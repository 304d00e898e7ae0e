//! `MemoryRegion::query_mr` (libfabric's `FI_EFA_DOMAIN_OPS` `query_mr`, rdma-core's
//! `efadv_query_mr`, issue 28): a region the efa device registered with its NIC reports the
//! NIC's interconnect ids (on the emulated NIC: all three, the device's index); a region of a
//! software device, which has no NIC, is `NotSupported`. Run on the efa device with
//! `EFA_TEST_DEVICE=efa efa-emu run -- cargo test --features efa --test query_mr`.

mod common;

use common::{device_domains, on_efa};
use efa::{Access, ErrorKind};

#[test]
fn query_mr_reports_the_nics_interconnects() {
    for (name, d, _keep) in device_domains("efa-query-mr") {
        let mr = d
            .register(vec![0u8; 8192], Access::REMOTE_READ | Access::REMOTE_WRITE)
            .unwrap();
        let q = mr.query_mr();
        if name == "efa" {
            let index: u16 = d
                .attr()
                .name
                .rsplit('_')
                .next()
                .and_then(|n| n.parse().ok())
                .expect("an emulated device is named efa_<index>");
            let q = q.unwrap();
            assert_eq!(
                (q.recv_ic_id, q.rdma_read_ic_id, q.rdma_recv_ic_id),
                (Some(index), Some(index), Some(index)),
                "{name}"
            );
            // Slices ask about their registration.
            let mut mr = mr;
            let tail = mr.split_off(4096).unwrap();
            assert_eq!(tail.query_mr().unwrap(), q);
        } else {
            let e = q.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::NotSupported, "{name}: {e}");
            assert!(e.to_string().contains("query_mr"), "{name}: {e}");
        }
    }
    if !on_efa() {
        eprintln!("(the efa device's case runs with EFA_TEST_DEVICE=efa under efa-emu)");
    }
}
