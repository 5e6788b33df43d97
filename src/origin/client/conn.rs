//! The upstream client's own HTTP/1.1 connections: opened on first use, kept idle per
//! serving thread, and driven by the task of the request that holds one, so a request
//! and its answer cross no channel and wake no other task. A connection goes back to its
//! idle list once its answer has been read to the end with nothing after it; an answer
//! read only in part, or followed by bytes nobody asked for, closes it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::uri::Authority;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{self, Chunked, Decoded, Framing, Head, WireError};

/// Spare room a read asks for (hyper's client reads in pieces of this size too).
const READ_ROOM: usize = 8192;
/// How often, at the shortest, idle lists are swept for expired connections.
const MIN_SWEEP: Duration = Duration::from_millis(90);

/// Why an exchange on the own path failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// The connection could not be opened.
    #[error("connecting to the upstream failed")]
    Connect(#[source] io::Error),
    /// Writing or reading failed.
    #[error("the upstream connection failed")]
    Io(#[source] io::Error),
    /// The connection closed before a byte of the answer came.
    #[error("the upstream closed the connection before answering")]
    Closed,
    /// The connection closed within the answer.
    #[error("the upstream closed the connection before the answer's end")]
    Incomplete,
    /// The answer broke HTTP/1.1.
    #[error("the upstream's answer cannot be read")]
    Wire(#[from] WireError),
}

/// One connection and what has been read from it but not used.
#[derive(Debug)]
pub struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

impl Conn {
    /// Whether the upstream has neither closed the idle connection nor sent on it.
    fn is_open(&self) -> bool {
        let mut probe = [0u8; 1];
        matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

/// The idle connections of each serving thread (and one list for every other thread).
#[derive(Debug)]
pub struct Pools {
    lists: Box<[Mutex<Vec<Idle>>]>,
    sweeping: Box<[AtomicBool]>,
    max_idle: usize,
    idle_timeout: Duration,
}

impl Pools {
    /// `lists` idle lists, each keeping at most `max_idle` connections for at most
    /// `idle_timeout`.
    pub fn new(lists: usize, max_idle: usize, idle_timeout: Duration) -> Arc<Pools> {
        Arc::new(Pools {
            lists: (0..lists).map(|_| Mutex::new(Vec::new())).collect(),
            sweeping: (0..lists).map(|_| AtomicBool::new(false)).collect(),
            max_idle,
            idle_timeout,
        })
    }

    fn list(&self, home: usize) -> MutexGuard<'_, Vec<Idle>> {
        self.lists[home]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most recently used idle connection of list `home` that is still open.
    fn take(&self, home: usize) -> Option<Conn> {
        loop {
            let idle = self.list(home).pop()?;
            if idle.since.elapsed() >= self.idle_timeout {
                // The rest were idle longer still.
                self.list(home).clear();
                return None;
            }
            if idle.conn.is_open() {
                return Some(idle.conn);
            }
        }
    }

    /// Keeps `conn` idle in list `home`, unless the list is full.
    fn give(self: &Arc<Self>, home: usize, conn: Conn) {
        let now = Instant::now();
        {
            let mut list = self.list(home);
            self.drop_expired(&mut list, now);
            if list.len() >= self.max_idle {
                return;
            }
            list.push(Idle { conn, since: now });
        }
        self.sweep_from_now_on(home);
    }

    fn drop_expired(&self, list: &mut Vec<Idle>, now: Instant) {
        let expired = list
            .iter()
            .take_while(|idle| now.duration_since(idle.since) >= self.idle_timeout)
            .count();
        list.drain(..expired);
    }

    /// Starts, once per list, the task that closes its connections once they expire or
    /// the upstream closes them, so that an idle list left alone does not hold them.
    /// It runs on the runtime of the thread the list belongs to, and ends with the pools.
    fn sweep_from_now_on(self: &Arc<Self>, home: usize) {
        if self.sweeping[home].swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeping[home].store(false, Ordering::Relaxed);
            return;
        };
        let pools = Arc::downgrade(self);
        let every = self.idle_timeout.max(MIN_SWEEP);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(pools) = pools.upgrade() else {
                    return;
                };
                let mut list = pools.list(home);
                pools.drop_expired(&mut list, Instant::now());
                list.retain(|idle| idle.conn.is_open());
            }
        });
    }
}

async fn connect(authority: &Authority) -> Result<Conn, ExchangeError> {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let io = TcpStream::connect((host, port))
        .await
        .map_err(ExchangeError::Connect)?;
    io.set_nodelay(true).map_err(ExchangeError::Connect)?;
    let probes = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
    socket2::SockRef::from(&io)
        .set_tcp_keepalive(&probes)
        .map_err(ExchangeError::Connect)?;
    Ok(Conn {
        io,
        buf: BytesMut::with_capacity(READ_ROOM),
    })
}

/// Sends `request` (a whole head, no body) on an idle connection of list `home` or a
/// new one, and reads the answer's head.
pub async fn exchange(
    pools: &Arc<Pools>,
    home: usize,
    authority: &Authority,
    request: &[u8],
) -> Result<(Head, AnswerBody), ExchangeError> {
    let mut conn = match pools.take(home) {
        Some(conn) => conn,
        None => connect(authority).await?,
    };
    conn.io
        .write_all(request)
        .await
        .map_err(ExchangeError::Io)?;
    let head = loop {
        if !conn.buf.is_empty()
            && let Some(head) = wire::parse_head(&mut conn.buf)?
        {
            break head;
        }
        conn.buf.reserve(READ_ROOM);
        let read = conn
            .io
            .read_buf(&mut conn.buf)
            .await
            .map_err(ExchangeError::Io)?;
        if read == 0 {
            return Err(if conn.buf.is_empty() {
                ExchangeError::Closed
            } else {
                ExchangeError::Incomplete
            });
        }
    };
    let body = AnswerBody::new(conn, &head, Arc::clone(pools), home);
    Ok((head, body))
}

/// The body of an answer read on the own path.
#[derive(Debug)]
pub struct AnswerBody {
    state: State,
}

#[derive(Debug)]
enum State {
    /// All of it, read with the head (the connection is already back in its list).
    Whole(Option<Bytes>),
    /// Still on the connection.
    Reading {
        conn: Conn,
        decode: Decode,
        /// Where the connection goes once the body has been read, if it may be reused.
        back_to: Option<(Arc<Pools>, usize)>,
    },
    Done,
}

#[derive(Debug)]
enum Decode {
    Length(u64),
    Chunked(Chunked),
    Close,
}

enum Found {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    More,
}

impl AnswerBody {
    fn new(mut conn: Conn, head: &Head, pools: Arc<Pools>, home: usize) -> AnswerBody {
        // A body that ends at the close leaves nothing to reuse.
        let reusable = head.keep_alive && head.framing != Framing::Close;
        let back_to = reusable.then_some((pools, home));
        let decode = match head.framing {
            Framing::Length(n) if n <= conn.buf.len() as u64 => {
                let data = conn.buf.split_to(n as usize).freeze();
                finish(conn, back_to);
                let state = State::Whole((!data.is_empty()).then_some(data));
                return AnswerBody { state };
            }
            Framing::Length(n) => Decode::Length(n),
            Framing::Chunked => Decode::Chunked(Chunked::default()),
            Framing::Close => Decode::Close,
        };
        AnswerBody {
            state: State::Reading {
                conn,
                decode,
                back_to,
            },
        }
    }

    /// Ends the body: its connection goes back to its list if it may.
    fn end(&mut self) {
        if let State::Reading { conn, back_to, .. } =
            std::mem::replace(&mut self.state, State::Done)
        {
            finish(conn, back_to);
        }
    }
}

/// Keeps `conn` for another request if it may be and nothing unasked-for follows the answer.
fn finish(conn: Conn, back_to: Option<(Arc<Pools>, usize)>) {
    if let Some((pools, home)) = back_to
        && conn.buf.is_empty()
    {
        pools.give(home, conn);
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ExchangeError>>> {
        let this = self.get_mut();
        loop {
            let State::Reading { conn, decode, .. } = &mut this.state else {
                return match &mut this.state {
                    State::Whole(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
                    _ => Poll::Ready(None),
                };
            };
            let found = match decode {
                Decode::Length(0) => Found::End,
                Decode::Length(_) | Decode::Close if conn.buf.is_empty() => Found::More,
                Decode::Length(left) => {
                    let n =
                        usize::try_from(*left).map_or(conn.buf.len(), |l| l.min(conn.buf.len()));
                    *left -= n as u64;
                    Found::Data(conn.buf.split_to(n).freeze())
                }
                Decode::Close => Found::Data(conn.buf.split().freeze()),
                Decode::Chunked(chunked) => match chunked.decode(&mut conn.buf) {
                    Ok(Decoded::Data(data)) => Found::Data(data),
                    Ok(Decoded::Trailers(fields)) => Found::Trailers(fields),
                    Ok(Decoded::End) => Found::End,
                    Ok(Decoded::More) => Found::More,
                    Err(e) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                },
            };
            match found {
                Found::Data(data) => {
                    if matches!(decode, Decode::Length(0)) {
                        this.end();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Found::Trailers(fields) => {
                    this.end();
                    return Poll::Ready(Some(Ok(Frame::trailers(fields))));
                }
                Found::End => {
                    this.end();
                    return Poll::Ready(None);
                }
                Found::More => {}
            }
            conn.buf.reserve(READ_ROOM);
            match conn.io.try_read_buf(&mut conn.buf) {
                Ok(0) if matches!(decode, Decode::Close) => {
                    this.end();
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.state = State::Done;
                    return Poll::Ready(Some(Err(ExchangeError::Incomplete)));
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Err(e) = ready!(conn.io.poll_read_ready(cx)) {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                    }
                }
                Err(e) => {
                    this.state = State::Done;
                    return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Whole(data) => data.is_none(),
            State::Reading { decode, .. } => matches!(decode, Decode::Length(0)),
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.state {
            State::Whole(Some(data)) => SizeHint::with_exact(data.len() as u64),
            State::Whole(None) | State::Done => SizeHint::with_exact(0),
            State::Reading {
                decode: Decode::Length(left),
                ..
            } => SizeHint::with_exact(*left),
            State::Reading { .. } => SizeHint::default(),
        }
    }
}
