//! TLS between nodes: `ractor_cluster`'s encrypted streams, with
//! certificates read from PEM files.
//!
//! A node with a certificate accepts only TLS peers on its address. It
//! runs its own acceptor in front of the node server (each handshake in a
//! task child, bounded in time and in number), because the node server's
//! listener completes each handshake before it accepts the next
//! connection: one peer that connects and says nothing would stop every
//! other. A node or client with a trust anchor (`--tls-ca`, else the
//! node's own certificate) connects to its peers over TLS and checks
//! their certificate against it and the host it dialled.
//!
//! The cookie still authenticates peers: TLS keeps what crosses the wire
//! private and the peer the one dialled; no client certificates.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, TaskSpec};
use ractor::ActorRef;
use ractor_cluster::{NetworkStream, NodeServerMessage};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;

/// The largest PEM file read.
const MAX_PEM: u64 = 1 << 20;
/// How long a peer may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in flight at once; connections past it are closed.
const MAX_HANDSHAKES: usize = 64;

/// TLS settings that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file is missing, too large, or holds no usable PEM block.
    #[error("{}: {why}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The certificate and key do not make a configuration.
    #[error("TLS: {0}")]
    Config(String),
}

/// How this node speaks TLS.
#[derive(Clone)]
pub struct Tls {
    acceptor: Option<TlsAcceptor>,
    connector: TlsConnector,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("accepts", &self.acceptor.is_some())
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// A node with certificate chain `cert` and its `key`: it accepts TLS
    /// peers, and connects to peers whose certificate `ca` (else `cert`
    /// itself) vouches for.
    pub fn node(cert: &Path, key: &Path, ca: Option<&Path>) -> Result<Tls, TlsError> {
        let chain = certificates(cert)?;
        let key = private_key(key)?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| {
                TlsError::Config(format!(
                    "the key does not fit the certificate in {}: {e}",
                    cert.display()
                ))
            })?;
        let mut tls = Tls::client(ca.unwrap_or(cert))?;
        tls.acceptor = Some(TlsAcceptor::from(Arc::new(server)));
        Ok(tls)
    }

    /// A client that connects to peers whose certificate `ca` vouches for.
    pub fn client(ca: &Path) -> Result<Tls, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in certificates(ca)? {
            roots.add(c).map_err(|e| TlsError::File {
                path: ca.to_owned(),
                why: format!("not a usable trust anchor: {}", chain(&e)),
            })?;
        }
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(chain(&e).to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Tls {
            acceptor: None,
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// Whether it accepts peers (it has a certificate).
    pub fn accepts(&self) -> bool {
        self.acceptor.is_some()
    }

    pub(super) fn connector(&self) -> &TlsConnector {
        &self.connector
    }
}

/// The name a peer at `addr` (`HOST:PORT`) must hold a certificate for.
pub(super) fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned()).map_err(|e| {
        format!(
            "`{host}` is not a name a certificate can hold: {}",
            chain(&e)
        )
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let bad = |why: String| TlsError::File {
        path: path.to_owned(),
        why,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| bad(chain(&e).to_string()))?
        .len();
    if len > MAX_PEM {
        return Err(bad(format!(
            "{len} bytes; a PEM file here is at most {MAX_PEM}"
        )));
    }
    std::fs::read(path).map_err(|e| bad(chain(&e).to_string()))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::File {
            path: path.to_owned(),
            why: format!("not PEM: {}", chain(&e)),
        })?;
    if certs.is_empty() {
        return Err(TlsError::File {
            path: path.to_owned(),
            why: "holds no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = pem(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::File {
        path: path.to_owned(),
        why: format!("holds no private key: {}", chain(&e)),
    })
}

/// Accepts TLS peers on `listener` for `server` until `stop`: each
/// handshake runs in a task child of `ctx`, within [`HANDSHAKE_TIMEOUT`],
/// at most [`MAX_HANDSHAKES`] at once.
pub(super) async fn accept(
    listener: tokio::net::TcpListener,
    tls: Tls,
    server: ActorRef<NodeServerMessage>,
    ctx: Context,
    stop: CancellationToken,
) {
    let Some(acceptor) = tls.acceptor else { return };
    let room = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("tls: accepting a peer: {}", chain(&e));
                    // A full table of descriptors: give it a moment.
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                        () = stop.cancelled() => return,
                    }
                }
            },
            () = stop.cancelled() => return,
        };
        let Ok(permit) = room.clone().try_acquire_owned() else {
            tracing::warn!("tls: {MAX_HANDSHAKES} handshakes in flight; closing {peer}");
            continue;
        };
        let (acceptor, server) = (acceptor.clone(), server.clone());
        let spec = TaskSpec::new("tls-handshake", format!("handshake/{peer}"));
        let started = ctx.spawn_task(spec, move |stop| async move {
            let _permit = permit;
            handshake(stream, peer, acceptor, server, stop).await;
        });
        if let Err(e) = started {
            tracing::warn!("tls: cannot take {peer}: {}", chain(&e));
        }
    }
}

async fn handshake(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    server: ActorRef<NodeServerMessage>,
    stop: CancellationToken,
) {
    let local = match stream.set_nodelay(true).and_then(|()| stream.local_addr()) {
        Ok(a) => a,
        Err(e) => return tracing::warn!("tls: {peer}: {}", chain(&e)),
    };
    let done = tokio::select! {
        r = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)) => r,
        () = stop.cancelled() => return,
    };
    let stream = match done {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return tracing::warn!("tls: {peer}: the handshake failed: {}", chain(&e)),
        Err(_) => {
            return tracing::warn!(
                "tls: {peer}: no handshake within {HANDSHAKE_TIMEOUT:?}; closed"
            );
        }
    };
    let opened = NodeServerMessage::ConnectionOpened {
        stream: Box::new(NetworkStream::TlsServer {
            peer_addr: peer,
            local_addr: local,
            stream,
        }),
        is_server: true,
    };
    if server.send_message(opened).is_err() {
        tracing::warn!("tls: {peer}: the node server stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_are_refused_naming_the_file_and_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("dsh-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = Tls::client(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&missing.display().to_string()), "{e}");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "no pem here\n").unwrap();
        let e = Tls::client(&empty).unwrap_err().to_string();
        assert!(e.contains("no CERTIFICATE block"), "{e}");
        let huge = dir.join("huge.pem");
        std::fs::write(&huge, vec![b'a'; (MAX_PEM + 1) as usize]).unwrap();
        let e = Tls::client(&huge).unwrap_err().to_string();
        assert!(e.contains("at most"), "{e}");
        let garbled = dir.join("garbled.pem");
        std::fs::write(
            &garbled,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert!(Tls::client(&garbled).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_peers_name_is_the_host_it_was_dialled_at() {
        assert!(matches!(
            server_name("127.0.0.1:7400"),
            Ok(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            server_name("[::1]:7400"),
            Ok(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            server_name("node-b.internal:7400"),
            Ok(ServerName::DnsName(_))
        ));
        assert!(server_name("bad host:1").is_err());
    }
}
