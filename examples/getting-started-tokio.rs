//! The tagged exchange of `getting-started-tagged`, written with the async API under tokio:
//! every operation is a future (`tsend` / `trecv` are `send_async` / `recv_async` with a tag in
//! their options), awaited with a timeout. The two programs interoperate: either side can be
//! the other example.
//!
//! ```text
//! cargo run --example getting-started-tokio              # server: prints "address: efa://..."
//! cargo run --example getting-started-tokio -- <address> # client, in another terminal
//! ```
//!
//! `EFA_PROVIDER` picks the device (default `udp`; `shm` on one host).

use std::io::Write;
use std::time::Duration;

use efa::bytes::{Bytes, BytesMut};
use efa::{
    AddressVector, Completion, CompletionQueue, Domain, Endpoint, EpType, Error, ErrorKind, Hints,
    OpFuture, RawAddr, Rdm, RecvOptions, SendOptions, getinfo,
};

const HELLO_TAG: u64 = 0x1000;
const MSG_TAG: u64 = 0x4200;
const REPLY_TAG: u64 = 0x9000;
const COUNT: u64 = 3;

/// Awaits one operation for at most 10 s; its completion, or why it failed.
async fn done(op: OpFuture) -> efa::Result<Completion> {
    match tokio::time::timeout(Duration::from_secs(10), op).await {
        Ok(outcome) => outcome.into_result(),
        Err(_) => Err(Error::new(ErrorKind::TimedOut, "await")),
    }
}

fn tagged(tag: u64) -> SendOptions {
    SendOptions::default().with_tag(tag)
}

fn matching(tag: u64, ignore: u64) -> RecvOptions {
    RecvOptions::default().with_tag(tag, ignore)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> efa::Result<()> {
    let provider = std::env::var("EFA_PROVIDER").unwrap_or_else(|_| "udp".into());
    let info = getinfo(&Hints::new().provider(&provider).ep_type(EpType::Rdm))?.remove(0);
    let domain = Domain::open(&info)?;
    let cq = CompletionQueue::new(&domain, 64)?;
    let av = AddressVector::new(&domain);
    let ep = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;

    match std::env::args().nth(1) {
        None => {
            println!("address: {}", ep.addr());
            std::io::stdout().flush().ok();
            let hello =
                done(ep.recv_async(BytesMut::with_capacity(128), matching(HELLO_TAG, 0))).await?;
            let text =
                String::from_utf8_lossy(hello.buf.as_recv().unwrap_or_default()).into_owned();
            let client = av.insert(text.parse::<RawAddr>()?)?;
            // Post the three receives at once, then await them in order.
            let recvs: Vec<OpFuture> = (0..COUNT)
                .map(|_| ep.recv_async(BytesMut::with_capacity(64), matching(MSG_TAG, 0xff)))
                .collect();
            let mut total = 0;
            for r in recvs {
                let c = done(r).await?;
                let body = c.buf.as_recv().unwrap_or_default();
                println!("tag {:#x}: {}", c.tag, String::from_utf8_lossy(body));
                total += body.len();
            }
            let reply = format!("server got {COUNT} messages, {total} bytes");
            done(ep.send_async(client, Bytes::from(reply), tagged(REPLY_TAG))).await?;
        }
        Some(server) => {
            let server = av.insert(server.parse::<RawAddr>()?)?;
            let reply = ep.recv_async(BytesMut::with_capacity(128), matching(REPLY_TAG, 0));
            let me = Bytes::from(ep.addr().to_string());
            done(ep.send_async(server, me, tagged(HELLO_TAG))).await?;
            for i in 1..=COUNT {
                let body = Bytes::from(format!("message {i} of {COUNT}"));
                done(ep.send_async(server, body, tagged(MSG_TAG + i))).await?;
            }
            let reply = done(reply).await?;
            let body = reply.buf.as_recv().unwrap_or_default();
            println!("reply: {}", String::from_utf8_lossy(body));
        }
    }
    Ok(())
}
