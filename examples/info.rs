//! Lists the devices and endpoint types `efa` can use, like libfabric's `fi_info`.
//!
//! ```text
//! cargo run --example info                          # short form, every entry
//! cargo run --example info -- -p udp -e dgram -v    # fi_info -v style, udp DGRAM only
//! cargo run --example info -- -a 10.0.0.5 --json    # udp bound to 10.0.0.5, as JSON
//! FI_EFA_IFACE=udp-127.0.0.1 cargo run --example info
//! cargo run --example info -- --topo                # NICs x GPUs distances, NUMA, CPUs
//! cargo run --example info -- --topo -v             # ... and the PCI tree
//! cargo run --example info -- --near 0000:53:00.0   # NICs nearest that GPU first
//! SYSFS_PATH=/some/fake/sys cargo run --example info -- --topo
//! ```
//!
//! The configuration comes from the `FI_EFA_*` environment variables (see `docs/config.md`); an
//! invalid value, or no matching entry, is printed on stderr and the exit status is 1.

mod common;

use std::net::IpAddr;
use std::process::ExitCode;

use clap::Parser;
use efa::topo::{Distance, Near, Topology};
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
    /// Print the host topology instead (read from SYSFS_PATH, else /sys): the NICs x GPUs
    /// distance table with NUMA nodes and CPUs, like `nvidia-smi topo -m`; with -v the PCI tree
    /// too; with --json the topology as JSON.
    #[arg(short = 't', long = "topo")]
    topo: bool,
    /// List the NICs nearest this PCI device (a GPU's bus id, e.g. 0000:53:00.0) or NUMA node
    /// (node1) first, each with its distance.
    #[arg(short = 'n', long = "near")]
    near: Option<Near>,
    /// With --near: leave out NICs farther than this (PIX, PXB, PHB, NODE, SYS).
    #[arg(long = "max-distance", requires = "near")]
    max_distance: Option<Distance>,
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    if args.topo {
        return print_topology(&args);
    }
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
    if let Some(n) = args.near {
        hints = hints.near(n);
    }
    if let Some(d) = args.max_distance {
        hints = hints.max_distance(d);
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
        if let Some(d) = info.distance {
            println!("    distance: {d}");
        }
    }
}

/// `--topo`: the table (and with -v the tree, with --json everything as JSON).
fn print_topology(args: &Args) -> ExitCode {
    let topo = match Topology::detect() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("info: cannot read the topology: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&topo) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("info: cannot serialize: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
    print!("{}", topo.matrix());
    if args.verbose {
        println!();
        print!("{}", topo.tree());
    }
    if let Some(n) = &args.near {
        println!();
        match topo.nics_near(n) {
            Ok(v) => {
                println!("NICs nearest {n}:");
                for (nic, d) in v {
                    let name = nic.name.as_deref().unwrap_or("-");
                    println!("  {d:4}  {name:12}  {}", nic.addr);
                }
            }
            Err(e) => {
                eprintln!("info: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
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
