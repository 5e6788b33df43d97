//! Keep-alive HTTP/1.1 connections to the upstream, one idle list per serving thread.
//!
//! A connection is not driven by a task of its own: whoever holds it polls it. While a
//! request waits for its response head, the request's task polls the connection beside
//! the response; while the response body streams to the client, the body polls it
//! ([`PooledBody`]). When the body has been read to its end, the connection goes back to
//! the idle list of the thread it came from. So a passed-through request on a serving
//! thread takes no task spawn and no wake-up of another task for its upstream exchange:
//! the upstream's bytes are read by the task that answers the client.
//!
//! An idle connection is polled by no one. A checkout polls it once first, which finds a
//! connection the upstream closed while it was idle (it then tries the next one); a
//! request that was not written because its connection turned out closed is sent again
//! on another. A sweep closes connections that stayed idle past `pool_idle_timeout`.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::client::UpstreamBody;

type Conn = Connection<TokioIo<TcpStream>, UpstreamBody>;

/// Why a request could not be exchanged with the upstream.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// No connection could be opened.
    #[error("connecting to the upstream failed: {0}")]
    Connect(#[source] io::Error),
    /// The HTTP/1.1 exchange failed (on a connection, or while writing the body).
    #[error("upstream exchange failed: {0}")]
    Http(#[source] hyper::Error),
}

/// One upstream connection: the sender of requests and the connection state machine.
struct Lease {
    sender: SendRequest<UpstreamBody>,
    /// `None` once it has ended: dropping it hands a request it had not written back.
    conn: Option<Conn>,
    slot: usize,
}

struct Idle {
    lease: Box<Lease>,
    since: Instant,
}

/// Idle connections, per slot (a serving thread, or the last for every other thread).
pub struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    slots: Box<[Mutex<Vec<Idle>>]>,
    authority: Authority,
    max_idle: usize,
    idle_timeout: Duration,
}

/// How many times a request that was never written is offered to another connection.
const UNSENT_RETRIES: usize = 3;

impl Pool {
    /// A pool of `slots` idle lists for `authority` (`host[:port]`, port 80 if none).
    /// Starts the idle sweep when called on a tokio runtime; it ends with the pool.
    pub fn new(
        authority: Authority,
        slots: usize,
        max_idle: usize,
        idle_timeout: Duration,
    ) -> Pool {
        let shared = Arc::new(Shared {
            slots: (0..slots.max(1)).map(|_| Mutex::new(Vec::new())).collect(),
            authority,
            max_idle,
            idle_timeout,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep(Arc::downgrade(&shared)));
        }
        Pool { shared }
    }

    /// Sends `req` on an idle connection of `slot`, or on a new one, and waits for the
    /// response head. Not bounded in time: the caller is.
    pub async fn send(
        &self,
        slot: usize,
        mut req: Request<UpstreamBody>,
    ) -> Result<Response<PooledBody>, ExchangeError> {
        let slot = slot.min(self.shared.slots.len() - 1);
        let mut retries = 0;
        loop {
            let mut lease = match self.checkout(slot).await {
                Some(lease) => lease,
                None => self.shared.connect(slot).await?,
            };
            let sent = lease.sender.try_send_request(req);
            match drive(&mut lease, sent).await {
                Ok(resp) => {
                    let shared = Arc::clone(&self.shared);
                    return Ok(resp.map(|body| PooledBody {
                        body,
                        lease: Some(lease),
                        pool: shared,
                    }));
                }
                Err(mut failed) => match failed.take_message() {
                    Some(unsent) if retries < UNSENT_RETRIES => {
                        tracing::debug!(error = %failed.error(), "upstream connection closed before the request was written; trying another");
                        retries += 1;
                        req = unsent;
                    }
                    _ => return Err(ExchangeError::Http(failed.into_error())),
                },
            }
        }
    }

    /// An idle connection of `slot` that is still open, most recently used first.
    async fn checkout(&self, slot: usize) -> Option<Box<Lease>> {
        loop {
            let idle = self.shared.lock(slot).pop()?;
            if idle.since.elapsed() >= self.shared.idle_timeout {
                continue;
            }
            let mut lease = idle.lease;
            // One poll lets the connection read what arrived while it was idle: a close
            // by the upstream ends it here instead of failing the request.
            let open = poll_fn(|cx| Poll::Ready(lease.poll_open(cx))).await;
            if open && lease.sender.is_ready() {
                return Some(lease);
            }
        }
    }

    #[cfg(test)]
    fn idle(&self, slot: usize) -> usize {
        self.shared.lock(slot).len()
    }
}

impl Shared {
    fn lock(&self, slot: usize) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // The lists hold no invariant a panic could break halfway.
        self.slots[slot]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    async fn connect(&self, slot: usize) -> Result<Box<Lease>, ExchangeError> {
        let host = self.authority.host();
        // A bracketed IPv6 literal is looked up without its brackets.
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = self.authority.port_u16().unwrap_or(80);
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(ExchangeError::Connect)?;
        stream.set_nodelay(true).map_err(ExchangeError::Connect)?;
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        socket2::SockRef::from(&stream)
            .set_tcp_keepalive(&keepalive)
            .map_err(ExchangeError::Connect)?;
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(ExchangeError::Http)?;
        tracing::debug!(upstream = %self.authority, slot, "opened an upstream connection");
        Ok(Box::new(Lease {
            sender,
            conn: Some(conn),
            slot,
        }))
    }

    /// Puts a connection whose last exchange is complete back on its idle list.
    fn check_in(&self, mut lease: Box<Lease>, cx: &mut Context<'_>) {
        if !lease.poll_open(cx) || lease.sender.is_closed() {
            return;
        }
        let mut idle = self.lock(lease.slot);
        if idle.len() < self.max_idle {
            idle.push(Idle {
                lease,
                since: Instant::now(),
            });
        }
    }
}

impl Lease {
    /// Polls the connection; false once it has ended (closed or failed), which drops it.
    fn poll_open(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(conn) = &mut self.conn
            && Pin::new(conn).poll(cx).is_ready()
        {
            self.conn = None;
        }
        self.conn.is_some()
    }
}

/// Polls the lease's connection beside `sent` until `sent` completes. A connection that
/// ends first is dropped, which fails `sent` (with the request, if it was not written).
async fn drive<F: Future>(lease: &mut Lease, sent: F) -> F::Output {
    let mut sent = pin!(sent);
    poll_fn(|cx| {
        lease.poll_open(cx);
        sent.as_mut().poll(cx)
    })
    .await
}

/// Closes connections idle past the timeout, every half timeout, until the pool is gone.
async fn sweep(shared: Weak<Shared>) {
    let period = match shared.upgrade() {
        Some(s) => (s.idle_timeout / 2).max(Duration::from_millis(100)),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else { return };
        for slot in 0..s.slots.len() {
            let expired: Vec<Idle> = {
                let mut idle = s.lock(slot);
                let (old, fresh): (Vec<Idle>, Vec<Idle>) = idle
                    .drain(..)
                    .partition(|i| i.since.elapsed() >= s.idle_timeout);
                *idle = fresh;
                old
            };
            // Closed outside the lock.
            drop(expired);
        }
    }
}

/// A response body from the upstream, which drives its connection while it is read and
/// returns the connection to the pool once it has been read to its end.
pub struct PooledBody {
    body: Incoming,
    /// Boxed: a response is moved through every layer on its way out, and a connection's
    /// state is large.
    lease: Option<Box<Lease>>,
    pool: Arc<Shared>,
}

impl std::fmt::Debug for PooledBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBody")
            .field("end_stream", &self.body.is_end_stream())
            .field("pooled", &self.lease.is_some())
            .finish()
    }
}

impl PooledBody {
    fn finish(&mut self, cx: &mut Context<'_>) {
        if let Some(lease) = self.lease.take() {
            self.pool.check_in(lease, cx);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(lease) = &mut this.lease
            && !lease.poll_open(cx)
        {
            // Ended: what it read is in the body's channel; it is not reused.
            this.lease = None;
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => this.finish(cx),
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.finish(cx),
            Poll::Ready(Some(Err(_))) => this.lease = None,
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // Read to its end but dropped before a poll saw it end (a server stops polling
        // a body whose size hint is met): the connection is reusable. Any other drop
        // leaves a response half read, and its connection is closed.
        if self.lease.is_some() && self.body.is_end_stream() {
            self.finish(&mut Context::from_waker(Waker::noop()));
        }
    }
}

#[cfg(test)]
mod tests;
