//! Runtime configuration (placeholder: the full FI_EFA_* table is being written).

/// Every runtime parameter.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// `FI_EFA_TX_SIZE`: send queue size (0 = device default).
    pub tx_size: usize,
    /// `FI_EFA_RX_SIZE`: receive queue size (0 = device default).
    pub rx_size: usize,
    /// `FI_EFA_CQ_SIZE`: completion queue size.
    pub cq_size: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tx_size: 0,
            rx_size: 0,
            cq_size: 8192,
        }
    }
}

impl Config {
    /// Defaults overridden by `FI_EFA_*` environment variables.
    pub fn from_env() -> crate::Result<Config> {
        Ok(Config::default())
    }
}
