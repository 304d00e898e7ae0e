//! PLACEHOLDER — being replaced by the udp device implementation.
#![allow(missing_docs, dead_code)]
use crate::device::*;
use crate::stats::DeviceStats;
use std::sync::Arc;
#[derive(Clone, Debug, Default)]
pub struct UdpConfig;
#[derive(Debug)]
pub struct UdpDevice;
impl UdpDevice {
    pub fn open(_c: UdpConfig) -> Result<Arc<UdpDevice>> {
        todo!()
    }
}
impl Device for UdpDevice {
    fn attr(&self) -> &DeviceAttr {
        todo!()
    }
    fn create_qp(&self, _attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        todo!()
    }
    fn stats(&self) -> DeviceStats {
        todo!()
    }
}
