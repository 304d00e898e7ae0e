//! The Rust peer of `emu/tests/c_interop.rs` as a program of its own, so that it can run on the
//! crate's `efa` device under the emulated NIC (`efa-emu run`), which the test binary (no `efa`
//! feature) cannot. Not an example to learn from: the test starts it.
//!
//! ```text
//! cargo build --features efa --example c-interop-peer
//! C_INTEROP_EFA_PEER=target/debug/examples/c-interop-peer \
//!     cargo test -p efa-emu --test c_interop -- --ignored on_its_efa_device
//! ```

#[path = "../emu/tests/c/rust_peer.rs"]
mod rust_peer;

use std::io::Write;

fn main() {
    let inc: u32 = std::env::var("C_INTEROP_PEER")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let code = match rust_peer::run(inc) {
        Ok(()) => 0,
        Err(e) => {
            let seed = std::env::var("C_INTEROP_SEED").unwrap_or_default();
            println!("FAIL seed={seed}: {e}");
            1
        }
    };
    std::io::stdout().flush().ok();
    std::process::exit(code);
}
