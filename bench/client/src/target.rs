//! Where the client sends its requests and what they are: one `http://` URL, extra headers and one
//! JSON body, POSTed on HTTP/1.1 keep-alive connections of its own.

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

pub type Sender = SendRequest<Full<Bytes>>;

pub struct Target {
    /// `host:port` to connect to.
    addr: String,
    host: String,
    path: Uri,
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl Target {
    /// `headers` are `name: value` strings.
    pub fn new(url: &str, headers: &[String], body: String) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|e| format!("--url {url}: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!("--url {url}: only http:// URLs"));
        }
        let host = uri
            .authority()
            .ok_or_else(|| format!("--url {url}: no host"))?
            .to_string();
        let addr = if host.contains(':') {
            host.clone()
        } else {
            format!("{host}:80")
        };
        let path = uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(|e| format!("--url {url}: {e}"))?;
        let headers = headers
            .iter()
            .map(|h| {
                h.split_once(':')
                    .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
                    .ok_or_else(|| format!("--header {h:?}: expected `name: value`"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            addr,
            host,
            path,
            headers,
            body: Bytes::from(body),
        })
    }

    /// A new connection, its HTTP/1.1 driver running on its own task until the sender is dropped.
    pub async fn connect(&self) -> Result<Sender, String> {
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("nodelay: {e}"))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake {}: {e}", self.addr))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    pub fn request(&self) -> Result<Request<Full<Bytes>>, String> {
        let mut request = Request::post(self.path.clone())
            .header("host", &self.host)
            .header("content-type", "application/json");
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        request
            .body(Full::new(self.body.clone()))
            .map_err(|e| format!("request: {e}"))
    }
}
