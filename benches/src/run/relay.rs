//! A TCP relay in front of a simulated replica that can be killed, to emulate the replica's
//! process crashing (`--kill-replica`).
//!
//! The gateway is configured with the relay's address instead of the replica's. Every accepted
//! connection is piped byte for byte to the replica (TCP_NODELAY on both legs, as the simulator
//! sets on its own sockets, so streamed chunks are not held back by Nagle's algorithm).
//! [`Relay::kill`] does what the kernel does when an engine process dies: the listening socket
//! closes (new connections are refused) and every open connection closes at once, so streams in
//! flight break mid-response and idle keep-alive connections in the gateway's pool go dead.
//!
//! On the virtual clock both legs get the fixed socket buffers the replicas and the gateway get
//! there ([`super::socket_buffer_bytes`]), so concurrent requests pass in the order they were
//! sent.
//!
//! Stopping the simulator itself would not do this: its graceful shutdown stops accepting but
//! lets in-flight requests finish for up to two seconds of wall time (ten simulated seconds at time
//! scale 0.2), and the fault API (`POST /sim/faults`) only affects requests that arrive after it.

use std::net::SocketAddr;

use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// A running relay; dropping it stops it the same way [`Relay::kill`] does.
pub struct Relay {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Relay {
    /// Listen on a free 127.0.0.1 port and relay every connection to `upstream`, with
    /// `buffer_bytes` socket buffers on both legs (0: the kernel's autotuning).
    pub async fn start(upstream: SocketAddr, buffer_bytes: u32) -> std::io::Result<Relay> {
        let listening = socket(buffer_bytes)?;
        listening.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let listener = listening.listen(1024)?;
        let addr = listener.local_addr()?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    biased;
                    _ = stopped.wait_for(|stop| *stop) => break,
                    accepted = listener.accept() => {
                        if let Ok((inbound, _)) = accepted {
                            connections.spawn(pipe(inbound, upstream, buffer_bytes));
                        }
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
            // Close the port first (connections are refused from here on), then every socket.
            drop(listener);
            connections.abort_all();
            while connections.join_next().await.is_some() {}
        });
        Ok(Relay {
            addr,
            stop,
            task: Some(task),
        })
    }

    /// Base URL of the relay (`http://127.0.0.1:PORT`), to give the gateway.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Close the listening socket and every relayed connection; returns once all are closed.
    pub async fn kill(&mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // Aborting the task drops the listener and the set, which aborts every connection.
            task.abort();
        }
    }
}

/// An IPv4 TCP socket with `buffer_bytes` send and receive buffers (0: autotuned).
fn socket(buffer_bytes: u32) -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    if buffer_bytes > 0 {
        socket.set_send_buffer_size(buffer_bytes)?;
        socket.set_recv_buffer_size(buffer_bytes)?;
    }
    Ok(socket)
}

/// Pipe one accepted connection to `upstream` until either side closes.
async fn pipe(mut inbound: TcpStream, upstream: SocketAddr, buffer_bytes: u32) {
    let _ = inbound.set_nodelay(true);
    let Ok(connecting) = socket(buffer_bytes) else {
        return;
    };
    let Ok(mut outbound) = connecting.connect(upstream).await else {
        return;
    };
    let _ = outbound.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An echo server: writes back whatever it reads.
    async fn echo_server() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn relays_until_killed_then_breaks_open_connections_and_refuses_new_ones() {
        let upstream = echo_server().await;
        let mut relay = Relay::start(upstream, 0).await.unwrap();
        let addr = relay.addr;
        let mut open = TcpStream::connect(addr).await.unwrap();
        open.write_all(b"ping").await.unwrap();
        let mut reply = [0u8; 4];
        open.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"ping");

        relay.kill().await;
        // The open connection is closed by the relay: a read sees end of stream or a reset.
        let mut rest = Vec::new();
        let read = open.read_to_end(&mut rest).await;
        assert!(
            matches!(read, Ok(0)) || read.is_err(),
            "the open connection must break, got {read:?} {rest:?}"
        );
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "new connections must be refused"
        );
    }
}
