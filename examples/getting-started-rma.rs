//! An RMA write with immediate data between two processes, as in docs/getting-started.md: the
//! server registers a region peers may write, prints its address and the region's `RemoteKey`
//! as JSON; the client writes into it with immediate data, and the server gets one completion
//! carrying the 4 bytes once the data is in its memory.
//!
//! ```text
//! cargo run --example getting-started-rma                          # server: prints two lines
//! cargo run --example getting-started-rma -- <address> '<key json>' # client
//! ```
//!
//! `EFA_PROVIDER` picks the device (default `udp`; `shm` on one host).

use std::io::Write;
use std::time::Duration;

use efa::bytes::Bytes;
use efa::{
    Access, AddressVector, Completion, CompletionFlags, CompletionQueue, Domain, Endpoint, EpType,
    Error, ErrorKind, Hints, RawAddr, Rdm, RemoteKey, getinfo,
};

const OFFSET: u64 = 100;
const IMM: u32 = 7;

/// Reads completions (for at most 10 s) until one satisfies `want`; returns it.
fn wait_until(cq: &CompletionQueue, want: impl Fn(&Completion) -> bool) -> efa::Result<Completion> {
    let mut done = Vec::new();
    loop {
        if let Some(i) = done.iter().position(&want) {
            return Ok(done.swap_remove(i));
        }
        cq.wait(&mut done, 8, Some(Duration::from_secs(10)))?;
    }
}

fn main() -> efa::Result<()> {
    let provider = std::env::var("EFA_PROVIDER").unwrap_or_else(|_| "udp".into());
    let info = getinfo(&Hints::new().provider(&provider).ep_type(EpType::Rdm))?.remove(0);
    let domain = Domain::open(&info)?;
    let cq = CompletionQueue::new(&domain, 64)?;
    let av = AddressVector::new(&domain);
    let ep = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;

    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => {
            let region = domain.register(vec![0u8; 4096], Access::REMOTE_WRITE)?;
            let key = serde_json::to_string(&region.remote_key()?).expect("a key serializes");
            println!("address: {}", ep.addr());
            println!("key: {key}");
            std::io::stdout().flush().ok();
            // Polling the queue is all the target does; the bytes land without it.
            let c = wait_until(&cq, |c| c.flags.contains(CompletionFlags::REMOTE_WRITE))?;
            let at = OFFSET as usize;
            let got = region.read()[at..at + c.len].to_vec();
            println!(
                "immediate data {:?}, {} bytes at offset {OFFSET}: {}",
                c.data,
                c.len,
                String::from_utf8_lossy(&got)
            );
        }
        [server, key] => {
            let server = av.insert(server.parse::<RawAddr>()?)?;
            let key: RemoteKey = serde_json::from_str(key).map_err(|e| {
                Error::new(ErrorKind::InvalidArgument, "remote_key").with_detail(e.to_string())
            })?;
            let body = Bytes::from_static(b"written by the client");
            ep.write_data(server, body, key.at(OFFSET), IMM, 1)?;
            wait_until(&cq, |c| c.context == 1)?;
            println!(
                "wrote {} bytes with immediate data {IMM}",
                b"written by the client".len()
            );
        }
        _ => {
            eprintln!("usage: getting-started-rma [<server address> <key json>]");
            std::process::exit(2);
        }
    }
    Ok(())
}
