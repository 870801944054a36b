//! Shard URLs, told apart in one place: a local path, `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`, or an
//! object (`s3://`, `gs://`, `az://`, `https://`, `http://`). Everything that needs a path's scheme
//! asks [`ShardUrl::kind_of`] (a prefix test, nothing resolved) or parses it with [`ShardUrl::parse`].

use std::path::{Path, PathBuf};

use crate::error::LoadError;

/// What kind of shard a dataset path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    /// A local file (or directory to list).
    Local,
    /// A file on a `ubdirect serve` storage server.
    Ub,
    /// An object in an object store.
    Object,
}

/// The URL schemes of object-store datasets.
pub const OBJECT_SCHEMES: [&str; 5] = ["s3://", "gs://", "az://", "https://", "http://"];

/// A dataset path, parsed.
#[derive(Debug, Clone)]
pub enum ShardUrl {
    /// A local path, as written (`~/` is expanded where it is opened).
    Local(PathBuf),
    /// `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`.
    Ub(UbUrl),
    /// `s3://BUCKET/KEY`, `gs://BUCKET/KEY`, `az://CONTAINER/KEY`, `https://HOST/PATH`.
    Object(ObjectUrl),
}

impl ShardUrl {
    /// The kind of shard `p` names, from its scheme: the one place schemes are told apart.
    pub fn kind_of(p: &Path) -> ShardKind {
        if p.to_string_lossy().starts_with("ub://") {
            ShardKind::Ub
        } else if p
            .to_str()
            .is_some_and(|s| OBJECT_SCHEMES.iter().any(|x| s.starts_with(x)))
        {
            ShardKind::Object
        } else {
            ShardKind::Local
        }
    }

    /// Parses `p` by its kind (a `ub://` URL's hosts are resolved here).
    pub fn parse(p: &Path) -> Result<ShardUrl, LoadError> {
        Ok(match Self::kind_of(p) {
            ShardKind::Local => ShardUrl::Local(p.to_path_buf()),
            ShardKind::Ub => ShardUrl::Ub(UbUrl::parse(&p.to_string_lossy())?),
            ShardKind::Object => ShardUrl::Object(parse_object(&p.to_string_lossy())?),
        })
    }
}

/// A parsed `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`.
#[derive(Debug, Clone)]
pub struct UbUrl {
    /// The servers' addresses (resolved when parsed).
    pub addrs: Vec<std::net::SocketAddr>,
    /// `HOST:PORT[,HOST:PORT…]` as written: one client per distinct authority.
    pub authority: String,
    /// The root the server exports.
    pub root: String,
    /// The file under the root.
    pub path: String,
}

impl UbUrl {
    /// Parses `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`, resolving every `HOST:PORT`.
    pub fn parse(u: &str) -> Result<UbUrl, LoadError> {
        use std::net::ToSocketAddrs;
        let bad = |why: &str| LoadError::BadUrl {
            url: u.to_string(),
            why: format!(
                "dataset path {u:?}: {why} (expected ub://HOST:PORT[,HOST:PORT]/ROOT/PATH)"
            ),
        };
        let rest = u
            .strip_prefix("ub://")
            .ok_or_else(|| bad("not a ub:// URL"))?;
        let (auth, rest) = rest.split_once('/').ok_or_else(|| bad("no root"))?;
        let (root, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no path under the root"))?;
        let mut addrs = Vec::new();
        for h in auth.split(',') {
            let a = h
                .to_socket_addrs()
                .map_err(|e| bad(&format!("{h}: {e}")))?
                .next()
                .ok_or_else(|| bad(&format!("{h} resolves to nothing")))?;
            addrs.push(a);
        }
        Ok(UbUrl {
            addrs,
            authority: auth.to_string(),
            root: root.to_string(),
            path: path.to_string(),
        })
    }
}

/// The object stores a dataset path can name, by URL scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `s3://BUCKET/KEY`: AWS S3 and S3-compatible stores.
    S3,
    /// `gs://BUCKET/KEY`: Google Cloud Storage.
    Gcs,
    /// `az://CONTAINER/KEY`: Azure Blob Storage (the account from `[object_store]` or the
    /// environment).
    Azure,
    /// `https://HOST/PATH` (or `http://` with `allow_http`): a plain HTTP server; listing a prefix
    /// needs WebDAV (`PROPFIND`).
    Http,
}

/// A parsed object URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUrl {
    pub scheme: Scheme,
    /// `s3://bucket`, `gs://bucket`, `az://container` or `https://host:port`: one client each.
    pub store: String,
    /// The bucket or container (empty for HTTP).
    pub bucket: String,
    /// The object's key (or the prefix), without leading or trailing `/`.
    pub key: String,
}

impl ObjectUrl {
    /// The URL of `key` in the same store.
    pub fn url_of(&self, key: &str) -> String {
        format!("{}/{key}", self.store)
    }
}

/// `s3://bucket/key`, `gs://bucket/key`, `az://container/key`, `https://host[:port]/path` or
/// `http://host[:port]/path` → its parts.
fn parse_object(u: &str) -> Result<ObjectUrl, LoadError> {
    let bad = |why: &str| LoadError::BadUrl {
        url: u.to_string(),
        why: format!(
            "{u:?}: {why} (expected s3://BUCKET/KEY, gs://BUCKET/KEY, az://CONTAINER/KEY or https://HOST/PATH)"
        ),
    };
    let (scheme_name, rest) = u.split_once("://").ok_or_else(|| bad("not a URL"))?;
    let scheme = match scheme_name {
        "s3" => Scheme::S3,
        "gs" => Scheme::Gcs,
        "az" => Scheme::Azure,
        "http" | "https" => Scheme::Http,
        _ => return Err(bad("not an object-store scheme")),
    };
    let (head, key) = rest.split_once('/').unwrap_or((rest, ""));
    if head.is_empty() {
        return Err(bad(if scheme == Scheme::Http {
            "no host"
        } else {
            "no bucket"
        }));
    }
    if head.contains(['?', '#', '@']) || key.contains(['?', '#']) {
        return Err(bad(
            "query strings, fragments and credentials in the URL are not supported",
        ));
    }
    Ok(ObjectUrl {
        scheme,
        store: format!("{scheme_name}://{head}"),
        bucket: if scheme == Scheme::Http {
            String::new()
        } else {
            head.to_string()
        },
        key: key.trim_matches('/').to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_of_every_scheme_parse_and_bad_ones_are_config_errors() {
        let u = parse_object("s3://b/corpus/v3/").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.scheme, u.bucket.as_str(), u.key.as_str()),
            (Scheme::S3, "b", "corpus/v3")
        );
        assert_eq!(u.url_of("corpus/v3/x.bin"), "s3://b/corpus/v3/x.bin");
        let u = parse_object("gs://g/x.bin").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.scheme, u.store.as_str()), (Scheme::Gcs, "gs://g"));
        let u = parse_object("az://c").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.scheme, u.bucket.as_str(), u.key.as_str()),
            (Scheme::Azure, "c", "")
        );
        let u = parse_object("https://h:8443/a/b").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (
                u.scheme,
                u.store.as_str(),
                u.bucket.as_str(),
                u.key.as_str()
            ),
            (Scheme::Http, "https://h:8443", "", "a/b")
        );
        for bad in [
            "s3:///k",
            "https:///p",
            "ftp://h/p",
            "s3:/b",
            "",
            "https://u@h/p",
            "gs://b/k?x=1",
        ] {
            match parse_object(bad) {
                Err(LoadError::BadUrl { why, .. }) => {
                    assert!(why.contains("expected s3://"), "{bad}: {why}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn object_urls_are_recognised_and_local_paths_are_not() {
        for p in [
            "s3://b/k",
            "gs://b/k",
            "az://c/k",
            "https://h/p",
            "http://h/p",
        ] {
            assert_eq!(ShardUrl::kind_of(Path::new(p)), ShardKind::Object, "{p}");
        }
        for p in ["/data/x.bin", "s3", "relative/https://x"] {
            assert_eq!(ShardUrl::kind_of(Path::new(p)), ShardKind::Local, "{p}");
        }
        assert_eq!(ShardUrl::kind_of(Path::new("ub://h:1/r/p")), ShardKind::Ub);
    }
}
