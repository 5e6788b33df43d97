//! Telling cleartext HTTP/2 with prior knowledge (h2c) from HTTP/1.1 by the first bytes a
//! client sends: the HTTP/2 connection preface, or anything else. The bytes read to
//! decide are handed back in front of the stream. It does not parse either protocol.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// What every HTTP/2 connection starts with (RFC 9113 §3.4). No HTTP/1.1 request starts
/// with it: `PRI` is reserved for it.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Which protocol a cleartext client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spoken {
    /// It sent the HTTP/2 preface.
    Http2,
    /// It sent something else (an HTTP/1.x request, or garbage for hyper to refuse).
    Http1,
}

/// Reads from `io` until its first bytes tell the protocol: as soon as they differ from
/// the preface (the first byte, for any HTTP/1.1 request), or once the whole preface is
/// there. The caller bounds the time. A client that closes before deciding is an
/// `UnexpectedEof` error.
pub async fn sniff<T: AsyncRead + Unpin>(mut io: T) -> io::Result<(Spoken, Prefixed<T>)> {
    let mut read = BytesMut::with_capacity(PREFACE.len());
    loop {
        if !PREFACE.starts_with(&read) {
            return Ok((Spoken::Http1, Prefixed::new(read, io)));
        }
        if read.len() >= PREFACE.len() {
            return Ok((Spoken::Http2, Prefixed::new(read, io)));
        }
        // Never past the preface: what follows is the protocol's to read.
        let mut chunk = [0u8; PREFACE.len()];
        let want = PREFACE.len() - read.len();
        let n = io.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        read.extend_from_slice(&chunk[..n]);
    }
}

/// A stream with bytes already read from it put back in front.
#[derive(Debug)]
pub struct Prefixed<T> {
    prefix: BytesMut,
    inner: T,
}

impl<T> Prefixed<T> {
    /// `inner`, read as if `prefix` had not been taken from it yet.
    pub fn new(prefix: BytesMut, inner: T) -> Prefixed<T> {
        Prefixed { prefix, inner }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            if self.prefix.is_empty() {
                // Read back whole: its room is not kept for the connection's life.
                self.prefix = BytesMut::new();
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    async fn sniffed(sent: &[u8]) -> (Spoken, Vec<u8>) {
        let (spoken, mut io) = sniff(sent).await.expect("decided");
        let mut all = Vec::new();
        io.read_to_end(&mut all).await.expect("read back");
        (spoken, all)
    }

    #[tokio::test]
    async fn the_preface_is_http2_and_everything_is_read_back() {
        let mut sent = PREFACE.to_vec();
        sent.extend_from_slice(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        assert_eq!(sniffed(&sent).await, (Spoken::Http2, sent.clone()));
    }

    #[tokio::test]
    async fn anything_else_is_http1_and_read_back_whole() {
        for sent in [
            &b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"[..],
            b"PRI / HTTP/1.1\r\n\r\n",
            b"P",
        ] {
            if sent == b"P" {
                // A prefix of the preface and then the end: undecided.
                assert!(sniff(sent).await.is_err());
                continue;
            }
            assert_eq!(sniffed(sent).await, (Spoken::Http1, sent.to_vec()));
        }
    }

    #[tokio::test]
    async fn a_preface_in_pieces_is_still_recognised() {
        let (mut client, server) = tokio::io::duplex(64);
        let task = tokio::spawn(sniff(server));
        for piece in PREFACE.chunks(5) {
            tokio::io::AsyncWriteExt::write_all(&mut client, piece)
                .await
                .expect("write");
        }
        let (spoken, _) = task.await.expect("join").expect("decided");
        assert_eq!(spoken, Spoken::Http2);
    }
}
