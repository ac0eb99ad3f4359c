//! Connections from a unix listener, normalised for h2 on the way in
//! ([`crate::normalize`]); what the server writes goes out untouched.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{UnixListener, UnixStream},
};
use tokio_stream::{Stream, StreamExt, wrappers::UnixListenerStream};
use tonic::transport::server::{Connected, UdsConnectInfo};

use crate::normalize::Normalizer;

/// How much is read from the socket at a time.
const READ_CHUNK: usize = 16 * 1024;

/// A client connection whose header blocks h2 reads normalised.
pub struct Normalized<S> {
    inner: S,
    norm: Normalizer,
    /// Normalised bytes h2 has not read yet, from `sent` on.
    out: Vec<u8>,
    sent: usize,
    scratch: Box<[u8]>,
    eof: bool,
}

impl<S> Normalized<S> {
    pub fn new(inner: S) -> Self {
        Normalized {
            inner,
            norm: Normalizer::new(),
            out: Vec::new(),
            sent: 0,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            eof: false,
        }
    }

    /// Header blocks whose authority was replaced on this connection.
    pub fn rewritten(&self) -> u64 {
        self.norm.rewritten()
    }
}

/// The connections of `listener`, normalised, for tonic's `serve_with_incoming`.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<Normalized<UnixStream>>> + Send + 'static {
    UnixListenerStream::new(listener).map(|c| c.map(Normalized::new))
}

impl<S: AsyncRead + Unpin> AsyncRead for Normalized<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.sent < this.out.len() {
                let n = (this.out.len() - this.sent).min(buf.remaining());
                buf.put_slice(&this.out[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.out.len() {
                    this.out.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            // Read until something is ready for h2: a partial frame yields nothing yet,
            // and returning no bytes would read as the end of the connection.
            let mut rb = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let got = rb.filled();
                    if got.is_empty() {
                        this.eof = true;
                        this.norm.finish(&mut this.out);
                    } else {
                        this.norm.feed(got, &mut this.out);
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Normalized<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The peer credentials tonic hands to the service (`UdsConnectInfo`), from the socket
/// underneath: the agent authorises callers by them.
impl Connected for Normalized<UnixStream> {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
