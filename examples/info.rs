//! Lists the devices and endpoint types `efa` can use, like libfabric's `fi_info`.
//!
//! ```text
//! cargo run --example info                          # short form, every entry
//! cargo run --example info -- -p udp -e dgram -v    # fi_info -v style, udp DGRAM only
//! cargo run --example info -- -a 10.0.0.5 --json    # udp bound to 10.0.0.5, as JSON
//! FI_EFA_IFACE=udp-127.0.0.1 cargo run --example info
//! ```
//!
//! The configuration comes from the `FI_EFA_*` environment variables (see `docs/config.md`); an
//! invalid value, or no matching entry, is printed on stderr and the exit status is 1.

mod common;

use std::net::IpAddr;
use std::process::ExitCode;

use clap::Parser;
use efa::{Caps, EpType, Hints, Info, getinfo};

/// List efa devices and endpoint types (like fi_info).
#[derive(Parser, Debug)]
#[command(name = "info", version)]
struct Args {
    /// Only this provider (device kind): udp, loopback, efa, shm.
    #[arg(short = 'p', long = "provider")]
    provider: Option<String>,
    /// Only this endpoint type: rdm or dgram.
    #[arg(short = 'e', long = "ep-type")]
    ep_type: Option<EpType>,
    /// Local IP address the udp device binds (default 127.0.0.1).
    #[arg(short = 'a', long = "addr")]
    addr: Option<IpAddr>,
    /// Only this device or domain name (e.g. udp-127.0.0.1 or udp-127.0.0.1-dgrm).
    #[arg(short = 'd', long = "domain")]
    domain: Option<String>,
    /// Required capabilities, e.g. "FI_MSG|FI_SOURCE" or "msg,tagged".
    #[arg(short = 'c', long = "caps")]
    caps: Option<Caps>,
    /// Print every attribute (like fi_info -v).
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// Print a JSON array of every entry with all attributes and the configuration.
    #[arg(long = "json", conflicts_with = "verbose")]
    json: bool,
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let mut hints = Hints::new();
    if let Some(p) = &args.provider {
        hints = hints.provider(p);
    }
    if let Some(t) = args.ep_type {
        hints = hints.ep_type(t);
    }
    if let Some(a) = args.addr {
        hints = hints.addr(a);
    }
    if let Some(d) = &args.domain {
        hints = hints.domain(d);
    }
    if let Some(c) = args.caps {
        hints = hints.caps(c);
    }
    let infos = match getinfo(&hints) {
        Ok(infos) => infos,
        Err(e) => {
            eprintln!("fi_getinfo: -{} ({e})", e.kind().fi_errno());
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        let json = serde_json::to_value(&infos).map(|mut v| {
            exact_in_js(&mut v);
            v
        });
        match json.and_then(|v| serde_json::to_string_pretty(&v)) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("info: cannot serialize: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        for info in &infos {
            print_info(info, args.verbose);
        }
    }
    ExitCode::SUCCESS
}

fn print_info(info: &Info, verbose: bool) {
    if verbose {
        println!("{}", info.verbose());
    } else {
        println!("{info}");
    }
}

/// Integers above 2^53 as strings: JSON readers that keep numbers as doubles (JavaScript, jq)
/// would round them (`max_msg_size` is 2^64 - 1, `mem_tag_format` uses all 64 bits).
fn exact_in_js(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.as_u64().is_some_and(|x| x > 1 << 53) => {
            *v = Value::String(n.to_string());
        }
        Value::Array(a) => a.iter_mut().for_each(exact_in_js),
        Value::Object(o) => o.values_mut().for_each(exact_in_js),
        _ => {}
    }
}
