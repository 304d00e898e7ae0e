//! The async API under tokio: two RDM endpoints exchange messages with `send_async` /
//! `recv_async`, and a receive whose future is dropped by a timeout loses nothing.
//!
//! ```text
//! cargo run --example async-tokio
//! ```
//!
//! The futures need no particular runtime (the device's wake-ups drive their `Waker`); tokio is
//! only the executor here.

mod common;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use efa::{
    AddressVector, CompletionQueue, Domain, Endpoint, EpType, Hints, Rdm, RecvOptions, SendOptions,
    getinfo,
};

fn endpoint(domain: &Domain) -> efa::Result<(CompletionQueue, AddressVector, Endpoint<Rdm>)> {
    let cq = CompletionQueue::new(domain, 256)?;
    let av = AddressVector::new(domain);
    let ep = Endpoint::<Rdm>::builder(domain).cq(&cq).av(&av).build()?;
    Ok((cq, av, ep))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> efa::Result<()> {
    common::init_tracing();
    let info = getinfo(&Hints::new().provider("udp").ep_type(EpType::Rdm))?.remove(0);
    let domain = Domain::open(&info)?;
    let (_cq_a, av_a, a) = endpoint(&domain)?;
    let (_cq_b, av_b, b) = endpoint(&domain)?;
    let to_b = av_a.insert(b.addr())?;
    let to_a = av_b.insert(a.addr())?;

    // A request and its reply, each side awaiting its own operations.
    let request = Bytes::from(vec![1u8; 200_000]);
    let server = async {
        let req = b
            .recv_async(BytesMut::with_capacity(200_000), RecvOptions::default())
            .await
            .into_result()?;
        let reply = format!("got {} bytes", req.len);
        b.send_async(
            to_a,
            Bytes::from(reply.into_bytes()),
            SendOptions::default(),
        )
        .await
        .into_result()?;
        Ok::<(), efa::Error>(())
    };
    let client = async {
        let reply = a.recv_async(BytesMut::with_capacity(64), RecvOptions::default());
        a.send_async(to_b, request.clone(), SendOptions::default())
            .await
            .into_result()?;
        let reply = reply.await.into_result()?;
        println!(
            "client: {}",
            String::from_utf8_lossy(reply.buf.as_recv().unwrap_or_default())
        );
        Ok::<(), efa::Error>(())
    };
    let (s, c) = tokio::join!(server, client);
    s?;
    c?;

    // Cancel safety: a receive whose future is dropped (here by a timeout) is cancelled; the
    // endpoint never frees memory the device may still use, and no message is lost (had one
    // matched already, it would go to the next receive).
    let tagged = RecvOptions::default().with_tag(7, 0);
    let timed_out = tokio::time::timeout(
        Duration::from_millis(20),
        b.recv_async(BytesMut::with_capacity(16), tagged),
    )
    .await;
    println!(
        "receive with nothing to receive: {}",
        if timed_out.is_err() {
            "timed out, future dropped"
        } else {
            "completed"
        }
    );
    // The dropped receive took nothing: the next tagged receive gets the first message.
    a.send_async(
        to_b,
        Bytes::from_static(b"first"),
        SendOptions::default().with_tag(7),
    )
    .await
    .into_result()?;
    a.send_async(
        to_b,
        Bytes::from_static(b"second"),
        SendOptions::default().with_tag(7),
    )
    .await
    .into_result()?;
    let next = b
        .recv_async(BytesMut::with_capacity(16), tagged)
        .await
        .into_result()?;
    println!(
        "next tagged receive: {}",
        String::from_utf8_lossy(next.buf.as_recv().unwrap_or_default())
    );
    Ok(())
}
