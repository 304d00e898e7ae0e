//! PLACEHOLDER — being replaced by the loopback device implementation.
#![allow(missing_docs, dead_code)]
use crate::device::*;
use crate::fault::FaultConfig;
use crate::stats::DeviceStats;
use std::sync::Arc;
#[derive(Clone, Debug)]
pub struct LoopbackNetwork;
impl LoopbackNetwork {
    pub fn new(_faults: FaultConfig) -> LoopbackNetwork {
        LoopbackNetwork
    }
    pub fn global() -> LoopbackNetwork {
        LoopbackNetwork
    }
}
#[derive(Clone, Debug, Default)]
pub struct LoopbackConfig;
#[derive(Debug)]
pub struct LoopbackDevice;
impl LoopbackDevice {
    pub fn open(_n: &LoopbackNetwork, _c: LoopbackConfig) -> Result<Arc<LoopbackDevice>> {
        todo!()
    }
}
impl Device for LoopbackDevice {
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
