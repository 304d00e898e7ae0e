//! `Endpoint::<Rdm>::builder(..).build()`: the queue pair, the engine and its configuration, the
//! local path, the receive buffers; and the optional progress thread.

use super::*;
use crate::progress::Background;

builder_setters! {
    EndpointBuilder<Rdm> {
        /// Starts a progress thread that drives the endpoint while the application does not poll
        /// (real automatic progress). Off by default: progress is manual, driven by polling or
        /// waiting on the completion queues.
        progress_thread: bool;
        /// Whether messages to peers on this host bypass the protocol engine through shared-memory
        /// channels (default on; it takes effect on devices with a shm directory: `shm`, and `udp`
        /// or `efa` routed over shm). Off, such peers are reached through the device as any other.
        /// Matching, ordering and completions are the same either way; see `docs/rdm.md`, "Local
        /// fast path".
        local_path: bool;
    }
}

impl EndpointBuilder<Rdm> {
    /// Where the progress thread runs: unpinned (default), on one CPU, or near the device's NUMA
    /// node. Implies [`progress_thread(true)`](Self::progress_thread) unless `Unpinned`. A CPU
    /// the process may not run on makes [`build`](Self::build) fail with `InvalidArgument`.
    pub fn progress_cpu(mut self, cpu: ProgressCpu) -> Self {
        self.progress_cpu = cpu;
        if cpu != ProgressCpu::Unpinned {
            self.progress_thread = true;
        }
        self
    }

    /// Creates the endpoint, its SRD queue pair and its protocol engine.
    pub fn build(self) -> Result<Endpoint<Rdm>> {
        let parts = self.parts()?;
        let attr = self.domain.attr().clone();
        if attr.gid.to_ip().is_unspecified() {
            // Peers check the raw address an RDM endpoint puts in its packets against where the
            // packets came from; `0.0.0.0` or `::` matches nothing.
            return Err(Error::new(ErrorKind::InvalidArgument, "ep_open").with_detail(format!(
                "device {} has the unspecified GID {}: bind it to a routable address for RDM endpoints",
                attr.name, attr.gid
            )));
        }
        let cfg = self.domain.config().clone();
        let tx_ops = self.queue_size(
            self.tx_size,
            cfg.tx_size,
            attr.max_send_wr,
            attr.max_send_wr,
            "tx_size",
        )?;
        let rx_ops = self.queue_size(
            self.rx_size,
            cfg.rx_size,
            attr.max_recv_wr,
            attr.max_recv_wr,
            "rx_size",
        )?;
        // The queue pair's depths (its bounce buffers, pinned on efa): the configured sizes when
        // set, else the device kind's default; the engine's operation tables are not bounded
        // by them.
        let (send_depth, recv_depth) = self.qp_depths(&attr)?;
        let own = Arc::new(Notifier::new());
        let inject_size = crate::info::rdm_inject_size(&attr, &cfg);
        let options =
            self.options
                .resolve(&attr, cfg.device_rdma(attr.caps.rdma_read)?, inject_size)?;
        let use_rdma = options.use_device_rdma;
        let notifier = Self::qp_notifier(&parts, Some(&own));
        let qp = self.domain.device().create_qp(QpAttr {
            qp_type: QpType::Srd,
            send_depth,
            recv_depth,
            rnr_retry: options.rnr_retry,
            qkey: None,
            notifier: notifier.clone(),
            // FI_EFA_USE_UNSOLICITED_WRITE_RECV: ask for it only when allowed.
            unsolicited_write_recv: Some(cfg.use_unsolicited_write_recv),
            same_host_route: options.shared_memory_permitted,
        })?;
        let addr = qp.addr();
        let local = match self.domain.device().local_dir() {
            Some(dir) if self.local_path && options.shared_memory_permitted => {
                LocalPath::open(dir, &addr, tx_ops, &notifier)
            }
            _ => None,
        };
        let now = Instant::now();
        let sizes = EngineSizes {
            send_depth,
            tx_ops,
            rx_ops,
        };
        let seed = u64::from(addr.qkey) ^ u64::from(addr.qpn) << 32;
        let mut engine = Engine::new(
            EngineConfig::new(&cfg, &attr, sizes, use_rdma, seed),
            addr,
            now,
        );
        // Peers' emulated RMA and atomics reach this domain's regions.
        engine.set_memory(Arc::new(self.domain.clone()));
        // Counted peers' accesses must reach the engine (no device RDMA advertised for them).
        engine.set_remote_events(
            parts.counters.counts(CntrKind::RemoteWrite),
            parts.counters.counts(CntrKind::RemoteRead),
        );
        // The HANDSHAKE advertises what the queue pair does, not what the device could.
        engine.set_unsolicited_write_recv(qp.unsolicited_write_recv());
        let rx_bufs = recv_depth;
        let region_rdma = use_rdma && qp.region_rdma();
        let region_write = use_rdma && qp.region_rdma_write();
        let core = Arc::new(RdmCore {
            domain: self.domain.clone(),
            parts,
            addr,
            region_send_min: if use_rdma && attr.caps.rdma_read {
                cfg.inter_min_read_message_size.max(1)
            } else {
                usize::MAX
            },
            region_rdma,
            region_write,
            inject_size,
            notifier: own,
            state: Mutex::new(State {
                engine,
                qp,
                ops: Slab::new(),
                scratch: Vec::new(),
                sends: VecDeque::new(),
                rdma: VecDeque::new(),
                pending: Default::default(),
                closed: false,
                rx_free: Vec::new(),
                rx_posted: 0,
                rx_buf_size: attr.mtu,
                rx_refill_threshold: cfg
                    .internal_rx_refill_threshold
                    .clamp(1, (recv_depth / 2).max(1)),
                cq_read_size: cfg.efa_cq_read_size.max(1),
                local,
                src_cache: SrcCache::default(),
                dest_cache: DestCache::default(),
                device_skips: 0,
                created: now,
            }),
            stop: Arc::new(AtomicBool::new(false)),
            thread: Mutex::new(None),
            orphans: Orphans::default(),
            options: LiveOptions::new(options),
        });
        {
            let mut st = core.state.lock();
            st.rx_free = (0..rx_bufs)
                .map(|i| (i as u64, BytesMut::with_capacity(attr.mtu)))
                .collect();
            st.rx_buf_size = attr.mtu;
            RdmCore::repost_rx(&mut st);
            if st.rx_posted == 0 {
                return Err(Error::new(ErrorKind::NoMemory, "ep_open")
                    .with_detail("no receive buffer could be posted"));
            }
        }
        let weak: Weak<dyn ProgressSource> = Arc::downgrade(&core) as _;
        if let Some(l) = core.state.lock().local.as_ref() {
            l.set_source(weak.clone());
        }
        core.parts.bind(weak);
        if self.progress_thread {
            let w = Arc::downgrade(&core);
            let stop = core.stop.clone();
            let notifier = core.notifier.clone();
            let cpu = crate::ep::pin::resolve(self.progress_cpu, &attr);
            let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
            let wake = notifier.clone();
            let handle = Background::spawn(
                format!("efa-progress-{}", addr.qpn),
                &core.stop,
                move || wake.notify(),
                move || {
                    let pinned = cpu.map_or(Ok(()), crate::ep::pin::pin_current);
                    let ok = pinned.is_ok();
                    let _ = pinned_tx.send(pinned);
                    if ok {
                        progress_thread(w, stop, notifier)
                    }
                },
            )
            .map_err(|e| Error::io("ep_open", e))?;
            let pinned = pinned_rx.recv().unwrap_or(Ok(()));
            if let Err(e) = pinned {
                drop(handle);
                return Err(e);
            }
            if let Some(c) = cpu {
                tracing::debug!(cpu = c, "progress thread pinned");
            }
            *core.thread.lock() = Some(handle);
        }
        tracing::debug!(%addr, tx_ops, rx_ops, "rdm_ep_open");
        Ok(Endpoint::from_core(core))
    }
}

pub(super) fn progress_thread(core: Weak<RdmCore>, stop: Arc<AtomicBool>, notifier: Arc<Notifier>) {
    while !stop.load(Ordering::Acquire) {
        let seen = notifier.generation();
        let next = match core.upgrade() {
            Some(c) => c.progress_once(),
            None => return,
        };
        let deadline = Instant::now()
            + next
                .unwrap_or(Duration::from_millis(10))
                .min(Duration::from_millis(10));
        notifier.wait_until(seen, Some(deadline));
    }
}
