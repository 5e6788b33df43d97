//! Answers written as hyper writes them, for the direct loop: the status line, the
//! answer's headers, `content-length` and `date` unless it states its own, then its
//! body, ready at once or as it comes; which answers are plain enough to be written
//! here ([`encode`]), and the per-thread `date` value.

use std::cell::RefCell;
use std::io;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header;
use http::{Response, StatusCode, Version};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// A body that streams is written whenever this much of it waits in the buffer, and a
/// piece of body larger than this is written from where it is, not copied.
const FLUSH_AT: usize = 16 * 1024;

/// An answer buffer grown past this is let go after its write, not kept for the next.
const KEEP_WRITE_BUFFER: usize = 8192;

/// Writes `out` whole and empties it, keeping its room up to [`KEEP_WRITE_BUFFER`].
pub(super) async fn write_out<T: AsyncWrite + Unpin>(
    io: &mut T,
    out: &mut Vec<u8>,
) -> io::Result<()> {
    io.write_all(out).await?;
    io.flush().await?;
    out.clear();
    if out.capacity() > KEEP_WRITE_BUFFER {
        *out = Vec::new();
    }
    Ok(())
}

/// What became of an answer handed to [`encode`].
pub(super) enum Encoded<B> {
    /// Written whole into the buffer.
    Whole,
    /// Its head and first bytes are in the buffer; the rest of its body is to come.
    Streaming(Rest<B>),
    /// Not plain: untouched, for hyper to write.
    NotPlain(Response<B>),
    /// Its body failed before a byte was written.
    Failed,
}

/// A body of known length with some of it still to write.
pub(super) struct Rest<B> {
    body: B,
    /// Bytes of the body still to write, `first` included.
    left: u64,
    /// Whether some of the body is in the buffer already.
    started: bool,
    /// A first frame too large to copy into the buffer, to write before the rest.
    first: Option<Bytes>,
}

/// Writes `resp` into `out` as hyper would, if it is plain: what of its body is ready
/// at once, the rest for [`fill`].
pub(super) fn encode<B: Body<Data = Bytes> + Unpin>(
    mut resp: Response<B>,
    out: &mut Vec<u8>,
) -> Encoded<B> {
    let status = resp.status();
    let plain = resp.version() == Version::HTTP_11
        && !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
        && resp
            .extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .is_none();
    let Some(len) = resp.body().size_hint().exact().filter(|_| plain) else {
        return Encoded::NotPlain(resp);
    };
    // A length the answer states itself is written where it stands, as hyper does, when
    // it is the body's; a date of its own replaces the server's.
    let (mut stated, mut dated) = (false, false);
    for (name, value) in resp.headers() {
        match *name {
            header::CONNECTION | header::TRANSFER_ENCODING | header::TRAILER => {
                return Encoded::NotPlain(resp);
            }
            header::CONTENT_LENGTH => {
                let this = std::str::from_utf8(value.as_bytes())
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok());
                if stated || this != Some(len) {
                    return Encoded::NotPlain(resp);
                }
                stated = true;
            }
            header::DATE => dated = true,
            _ => {}
        }
    }
    // The first frame, if the body has it ready.
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let first: Option<Bytes> = if len == 0 && resp.body().is_end_stream() {
        None
    } else {
        match std::pin::Pin::new(resp.body_mut()).poll_frame(&mut cx) {
            Poll::Pending => None,
            Poll::Ready(None) if len == 0 => None,
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => return Encoded::Failed,
            Poll::Ready(Some(Ok(frame))) => frame.into_data().ok(),
        }
    };
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in resp.headers() {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !stated {
        out.extend_from_slice(b"content-length: ");
        decimal(len, out);
        out.extend_from_slice(b"\r\n");
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        DATE.with(|d| d.borrow_mut().extend(out));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    let got = first.as_ref().map_or(0, |b| b.len() as u64);
    if got > len {
        // More than its length said: the connection cannot be framed any more.
        return Encoded::Failed;
    }
    match first {
        Some(large) if large.len() > FLUSH_AT => Encoded::Streaming(Rest {
            body: resp.into_body(),
            left: len,
            started: false,
            first: Some(large),
        }),
        first => {
            if let Some(data) = first {
                out.extend_from_slice(&data);
            }
            if got == len {
                return Encoded::Whole;
            }
            Encoded::Streaming(Rest {
                body: resp.into_body(),
                left: len - got,
                started: got > 0,
                first: None,
            })
        }
    }
}

/// Adds the rest of a body to `out` as it comes, and writes `out` whenever the next
/// frame is not ready (or more than [`FLUSH_AT`] waits): frames that come together go
/// out together, and a body that trickles is not held back. When none of the body was
/// ready with the head, the first frame is awaited before the head is written, so that
/// an answer whose body follows its head closely takes one write. An error (the
/// body's, or a body that ends short or runs long) ends the connection, as hyper's would.
pub(super) async fn fill<B, T>(io: &mut T, out: &mut Vec<u8>, rest: Rest<B>) -> io::Result<()>
where
    B: Body<Data = Bytes> + Unpin,
    T: AsyncWrite + Unpin,
{
    let Rest {
        mut body,
        mut left,
        mut started,
        first,
    } = rest;
    if let Some(data) = first {
        left -= data.len() as u64;
        push(io, out, data).await?;
        started = true;
    }
    while left > 0 {
        // The body's error is dropped at once: it need not be `Send` to be held here.
        let at_once = Context::from_waker(std::task::Waker::noop());
        let ready = match std::pin::Pin::new(&mut body).poll_frame(&mut { at_once }) {
            Poll::Ready(frame) => Some(frame.map(|f| f.map_err(drop))),
            Poll::Pending => None,
        };
        let frame = match ready {
            Some(frame) => frame,
            None => {
                if started {
                    write_out(io, out).await?;
                }
                body.frame().await.map(|f| f.map_err(drop))
            }
        };
        let Some(Ok(frame)) = frame else {
            return Err(io::Error::other(
                "the answer's body ended before its length",
            ));
        };
        if let Ok(data) = Frame::into_data(frame) {
            left = left
                .checked_sub(data.len() as u64)
                .ok_or_else(|| io::Error::other("the answer's body ran past its length"))?;
            push(io, out, data).await?;
            started = true;
        }
    }
    Ok(())
}

/// Adds a piece of body to `out`; writes `out` once it holds more than [`FLUSH_AT`], and
/// a piece larger than that from where it is, after what `out` holds.
async fn push<T: AsyncWrite + Unpin>(io: &mut T, out: &mut Vec<u8>, data: Bytes) -> io::Result<()> {
    if data.len() > FLUSH_AT {
        write_out(io, out).await?;
        io.write_all(&data).await?;
        return io.flush().await;
    }
    out.extend_from_slice(&data);
    if out.len() > FLUSH_AT {
        write_out(io, out).await?;
    }
    Ok(())
}

/// `n` in decimal.
pub(super) fn decimal(n: u64, out: &mut Vec<u8>) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

thread_local! {
    static DATE: RefCell<CachedDate> = const { RefCell::new(CachedDate { second: 0, value: [0; 29] }) };
}

/// The `date` value of the current second, formatted once a second per thread.
struct CachedDate {
    second: u64,
    value: [u8; 29],
}

impl CachedDate {
    fn extend(&mut self, out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if second != self.second {
            let formatted = httpdate::fmt_http_date(now);
            if formatted.len() == self.value.len() {
                self.value.copy_from_slice(formatted.as_bytes());
                self.second = second;
            } else {
                out.extend_from_slice(formatted.as_bytes());
                return;
            }
        }
        out.extend_from_slice(&self.value);
    }
}
