//! Tagged messages between two processes, as in docs/getting-started.md: the server prints its
//! address as text, the client takes it on its command line, sends its own address and three
//! tagged messages, and waits for the server's tagged reply.
//!
//! ```text
//! cargo run --example getting-started-tagged              # server: prints "address: efa://..."
//! cargo run --example getting-started-tagged -- <address> # client, in another terminal
//! ```
//!
//! `EFA_PROVIDER` picks the device (default `udp`; `shm` on one host).

use std::io::Write;
use std::time::Duration;

use efa::bytes::{Bytes, BytesMut};
use efa::{
    AddressVector, Completion, CompletionQueue, Domain, Endpoint, EpType, Hints, RawAddr, Rdm,
    getinfo,
};

/// The tag of the client's address; messages use `MSG_TAG + i`, the reply `REPLY_TAG`.
const HELLO_TAG: u64 = 0x1000;
const MSG_TAG: u64 = 0x4200;
const REPLY_TAG: u64 = 0x9000;
const COUNT: u64 = 3;

/// Waits until the completion with `context` arrives (up to 10 s) and takes it out of `done`,
/// which keeps the completions of other operations read meanwhile.
fn wait_for(
    cq: &CompletionQueue,
    done: &mut Vec<Completion>,
    context: u64,
) -> efa::Result<Completion> {
    loop {
        if let Some(i) = done.iter().position(|c: &Completion| c.context == context) {
            return Ok(done.swap_remove(i));
        }
        cq.wait(done, 8, Some(Duration::from_secs(10)))?;
    }
}

fn main() -> efa::Result<()> {
    let provider = std::env::var("EFA_PROVIDER").unwrap_or_else(|_| "udp".into());
    let info = getinfo(&Hints::new().provider(&provider).ep_type(EpType::Rdm))?.remove(0);
    let domain = Domain::open(&info)?;
    let cq = CompletionQueue::new(&domain, 64)?;
    let av = AddressVector::new(&domain);
    let ep = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;

    let mut done = Vec::new();
    match std::env::args().nth(1) {
        None => {
            // Server: tell the client where we are, then learn where it is.
            println!("address: {}", ep.addr());
            std::io::stdout().flush().ok();
            ep.trecv(BytesMut::with_capacity(128), HELLO_TAG, 0, 0)?;
            let hello = wait_for(&cq, &mut done, 0)?;
            let text =
                String::from_utf8_lossy(hello.buf.as_recv().unwrap_or_default()).into_owned();
            let client = av.insert(text.parse::<RawAddr>()?)?;
            // Three messages, tags MSG_TAG..MSG_TAG+2 matched by one ignore mask.
            for i in 1..=COUNT {
                ep.trecv(BytesMut::with_capacity(64), MSG_TAG, 0xff, i)?;
            }
            let mut total = 0;
            for i in 1..=COUNT {
                let c = wait_for(&cq, &mut done, i)?;
                let body = c.buf.as_recv().unwrap_or_default();
                println!("tag {:#x}: {}", c.tag, String::from_utf8_lossy(body));
                total += body.len();
            }
            let reply = format!("server got {COUNT} messages, {total} bytes");
            ep.tsend(client, Bytes::from(reply), REPLY_TAG, 100)?;
            wait_for(&cq, &mut done, 100)?;
        }
        Some(server) => {
            // Client: the server's address from the command line, ours in the first message.
            let server = av.insert(server.parse::<RawAddr>()?)?;
            ep.trecv(BytesMut::with_capacity(128), REPLY_TAG, 0, 100)?;
            ep.tsend(server, Bytes::from(ep.addr().to_string()), HELLO_TAG, 0)?;
            for i in 1..=COUNT {
                let body = format!("message {i} of {COUNT}");
                ep.tsend(server, Bytes::from(body), MSG_TAG + i, i)?;
            }
            for i in 0..=COUNT {
                wait_for(&cq, &mut done, i)?;
            }
            let reply = wait_for(&cq, &mut done, 100)?;
            let body = reply.buf.as_recv().unwrap_or_default();
            println!("reply: {}", String::from_utf8_lossy(body));
        }
    }
    Ok(())
}
