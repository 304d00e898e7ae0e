//! Seeded fault injection for the software devices: drop, duplicate, reorder and delay datagrams.
//!
//! Every decision comes from a small deterministic generator seeded by [`FaultConfig::seed`], so a
//! failing test replays exactly from the seed it prints.

use std::time::Duration;

/// A tiny, fast, seedable generator (SplitMix64). Not for cryptography.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A float uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }

    /// A value uniform in `0..n` (0 when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// A seed for tests: `EFA_TEST_SEED` if set, else one derived from the clock. Print it on failure.
pub fn test_seed() -> u64 {
    if let Some(s) = std::env::var("EFA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return s;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed);
    Rng::new(t ^ u64::from(std::process::id())).next_u64()
}

/// What faults a software device injects into the datagrams it sends.
///
/// Probabilities are per datagram, in `[0, 1]`.
///
/// ```
/// use efa::FaultConfig;
/// let f = FaultConfig::seeded(42).drop(0.1).duplicate(0.1).reorder(0.1);
/// assert!(f.validate().is_ok());
/// ```
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct FaultConfig {
    /// Seed of the decisions.
    pub seed: u64,
    /// Probability that a datagram is lost.
    pub drop: f64,
    /// Probability that a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back and delivered after later ones.
    pub reorder: f64,
    /// Probability that a datagram is delayed by up to `max_delay`.
    pub delay: f64,
    /// The longest added delay.
    pub max_delay: Duration,
}

builder_setters! {
    FaultConfig {
        /// Sets the drop probability.
        drop: f64;
        /// Sets the duplication probability.
        duplicate: f64;
        /// Sets the reordering probability.
        reorder: f64;
    }
}

impl FaultConfig {
    /// No faults, with a seed.
    pub fn seeded(seed: u64) -> FaultConfig {
        FaultConfig {
            seed,
            ..Default::default()
        }
    }

    /// Sets the delay probability and the longest delay.
    pub fn delay(mut self, p: f64, max: Duration) -> Self {
        self.delay = p;
        self.max_delay = max;
        self
    }

    /// True when no fault is configured.
    pub fn is_none(&self) -> bool {
        self.drop <= 0.0 && self.duplicate <= 0.0 && self.reorder <= 0.0 && self.delay <= 0.0
    }

    /// Checks that every probability lies in `[0, 1]`.
    pub fn validate(&self) -> crate::Result<()> {
        for (name, p) in [
            ("drop", self.drop),
            ("duplicate", self.duplicate),
            ("reorder", self.reorder),
            ("delay", self.delay),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(
                    crate::Error::new(crate::ErrorKind::InvalidArgument, "fault_config")
                        .with_detail(format!("{name} probability {p} outside [0, 1]")),
                );
            }
        }
        Ok(())
    }
}

/// The fate of one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Fate {
    /// Lost: not delivered at all.
    pub drop: bool,
    /// Delivered twice.
    pub duplicate: bool,
    /// Held back behind later datagrams.
    pub reorder: bool,
    /// Extra delay before delivery.
    pub delay: Duration,
}

/// Draws [`Fate`]s from a [`FaultConfig`].
#[derive(Clone, Debug)]
pub struct FaultInjector {
    cfg: FaultConfig,
    rng: Rng,
}

impl FaultInjector {
    /// An injector for `cfg`.
    pub fn new(cfg: FaultConfig) -> FaultInjector {
        let rng = Rng::new(cfg.seed);
        FaultInjector { cfg, rng }
    }

    /// The configuration.
    pub fn config(&self) -> &FaultConfig {
        &self.cfg
    }

    /// The generator, for device decisions that must replay from the same seed.
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Decides the fate of the next datagram.
    pub fn next_fate(&mut self) -> Fate {
        if self.cfg.is_none() {
            return Fate::default();
        }
        let c = &self.cfg;
        let drop = self.rng.chance(c.drop);
        let duplicate = self.rng.chance(c.duplicate);
        let reorder = self.rng.chance(c.reorder);
        let delay = if self.rng.chance(c.delay) && !c.max_delay.is_zero() {
            Duration::from_nanos(self.rng.below(c.max_delay.as_nanos() as u64 + 1))
        } else {
            Duration::ZERO
        };
        Fate {
            drop,
            duplicate,
            reorder,
            delay,
        }
    }
}
