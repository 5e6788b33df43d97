//! The data plane's certificate: a PEM chain and its private key read from files,
//! checked against each other with the ring provider, and the leaf's not-after time. It
//! reads files; serving TLS with the result is `server::tls`. The config names the files
//! ([`CertificateFiles`]) and checks them when it is compiled.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::sign::CertifiedKey;

/// Which of the two files a problem is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertFile {
    /// `cert_file`.
    Cert,
    /// `key_file`.
    Key,
}

/// Why a certificate and key could not be loaded. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum CertificateError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Which file it is.
        which: CertFile,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not PEM, or holds no item of the kind wanted.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Which file it is.
        which: CertFile,
        /// What was looked for.
        what: &'static str,
        /// The cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The key is not one the provider can sign with.
    #[error("{path}: unusable private key")]
    Key {
        /// The key file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
    /// The key is not the certificate's.
    #[error("{key} does not match the certificate in {cert}")]
    Mismatch {
        /// The key file.
        key: PathBuf,
        /// The certificate file.
        cert: PathBuf,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
    /// The first certificate's validity could not be read.
    #[error("{path}: the first certificate is not a readable X.509 certificate ({reason})")]
    Validity {
        /// The certificate file.
        path: PathBuf,
        /// What was wrong.
        reason: &'static str,
    },
}

impl CertificateError {
    /// The file the problem is in.
    pub fn file(&self) -> CertFile {
        match self {
            CertificateError::Read { which, .. } | CertificateError::Pem { which, .. } => *which,
            CertificateError::Key { .. } | CertificateError::Mismatch { .. } => CertFile::Key,
            CertificateError::Validity { .. } => CertFile::Cert,
        }
    }
}

/// A certificate chain with its key, ready for handshakes.
#[derive(Debug, Clone)]
pub struct LoadedCertificate {
    /// The chain and signing key.
    pub key: Arc<CertifiedKey>,
    /// The leaf certificate's not-after time, in seconds since the Unix epoch.
    pub not_after: i64,
}

/// Reads `cert_file` (a PEM chain, leaf first) and `key_file` (a PKCS#8, PKCS#1 or SEC1
/// PEM key), and checks that the key is the leaf's.
pub fn load(
    cert_file: &Path,
    key_file: &Path,
    provider: &CryptoProvider,
) -> Result<LoadedCertificate, CertificateError> {
    let cert_pem = read(cert_file, CertFile::Cert)?;
    let key_pem = read(key_file, CertFile::Key)?;
    let pem = |which, what| {
        let path = match which {
            CertFile::Cert => cert_file,
            CertFile::Key => key_file,
        };
        move |source| CertificateError::Pem {
            path: path.to_owned(),
            which,
            what,
            source,
        }
    };
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem(CertFile::Cert, "invalid PEM certificate"))?;
    let Some(leaf) = chain.first() else {
        return Err(pem(CertFile::Cert, "no PEM certificate in it")(
            rustls::pki_types::pem::Error::NoItemsFound,
        ));
    };
    let not_after = not_after(leaf).map_err(|reason| CertificateError::Validity {
        path: cert_file.to_owned(),
        reason,
    })?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(pem(
        CertFile::Key,
        "no PKCS#8, PKCS#1 or SEC1 PEM private key in it",
    ))?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|source| CertificateError::Key {
            path: key_file.to_owned(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        // A key whose public half the provider cannot tell (none of ring's) is not
        // refused for that alone.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(source) => {
            return Err(CertificateError::Mismatch {
                key: key_file.to_owned(),
                cert: cert_file.to_owned(),
                source,
            });
        }
    }
    Ok(LoadedCertificate {
        key: Arc::new(certified),
        not_after,
    })
}

fn read(path: &Path, which: CertFile) -> Result<Vec<u8>, CertificateError> {
    std::fs::read(path).map_err(|source| CertificateError::Read {
        path: path.to_owned(),
        which,
        source,
    })
}

/// The `notAfter` of an X.509 certificate (RFC 5280 §4.1), in Unix seconds.
fn not_after(cert: &[u8]) -> Result<i64, &'static str> {
    const SEQUENCE: u8 = 0x30;
    const VERSION: u8 = 0xa0;
    let (cert, _) = der_item(cert, SEQUENCE).ok_or("not a DER sequence")?;
    let (tbs, _) = der_item(cert, SEQUENCE).ok_or("no tbsCertificate")?;
    let rest = match der_item(tbs, VERSION) {
        Some((_, rest)) => rest,
        None => tbs,
    };
    let (_, rest) = der_item(rest, 0x02).ok_or("no serial number")?;
    let (_, rest) = der_item(rest, SEQUENCE).ok_or("no signature algorithm")?;
    let (_, rest) = der_item(rest, SEQUENCE).ok_or("no issuer")?;
    let (validity, _) = der_item(rest, SEQUENCE).ok_or("no validity")?;
    let (_, _, rest) = der_any(validity).ok_or("no notBefore")?;
    let (tag, time, _) = der_any(rest).ok_or("no notAfter")?;
    asn1_time(tag, time).ok_or("unreadable notAfter")
}

/// The content of the DER item at the start of `input` if its tag is `tag`, and what
/// follows it.
fn der_item(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (found, content, rest) = der_any(input)?;
    (found == tag).then_some((content, rest))
}

/// The tag and content of the DER item at the start of `input`, and what follows it.
fn der_any(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (bytes, rest) = rest.split_at_checked(n)?;
        let len = bytes
            .iter()
            .fold(0usize, |len, &b| (len << 8) | usize::from(b));
        (len, rest)
    };
    let (content, rest) = rest.split_at_checked(len)?;
    Some((tag, content, rest))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950 to 2049) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`), in Unix seconds.
fn asn1_time(tag: u8, text: &[u8]) -> Option<i64> {
    const UTC_TIME: u8 = 0x17;
    const GENERALIZED_TIME: u8 = 0x18;
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    let digits = |s: &str| -> Option<u32> {
        s.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    let (year, rest) = match tag {
        UTC_TIME if text.len() == 12 => {
            let yy = digits(text.get(..2)?)?;
            let year = if yy >= 50 { 1900 + yy } else { 2000 + yy };
            (year, text.get(2..)?)
        }
        GENERALIZED_TIME if text.len() == 14 => (digits(text.get(..4)?)?, text.get(4..)?),
        _ => return None,
    };
    let field = |at: usize| digits(rest.get(at..at + 2)?);
    let date = chrono::NaiveDate::from_ymd_opt(i32::try_from(year).ok()?, field(0)?, field(2)?)?;
    let time = date.and_hms_opt(field(4)?, field(6)?, field(8)?)?;
    Some(time.and_utc().timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_time_forms() {
        assert_eq!(asn1_time(0x17, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(asn1_time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(asn1_time(0x18, b"20500101000000Z"), Some(2_524_608_000));
        assert_eq!(asn1_time(0x17, b"7001010000Z"), None);
        assert_eq!(asn1_time(0x18, b"2050010100000+Z"), None);
        assert_eq!(asn1_time(0x17, b"701301000000Z"), None);
        assert_eq!(asn1_time(0x04, b"700101000000Z"), None);
    }

    #[test]
    fn der_lengths_in_long_form() {
        let mut item = vec![0x30, 0x82, 0x01, 0x00];
        item.extend(std::iter::repeat_n(7u8, 256));
        item.push(0xff);
        let (content, rest) = der_item(&item, 0x30).expect("an item");
        assert_eq!(content.len(), 256);
        assert_eq!(rest, [0xff]);
        assert!(der_item(&item[..100], 0x30).is_none(), "truncated");
        assert!(der_item(&[0x30, 0x80], 0x30).is_none(), "indefinite length");
        assert!(not_after(b"not a certificate").is_err());
    }
}

/// The one crypto provider of the process's TLS: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Where the certificate and key are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFiles {
    /// The PEM chain.
    pub cert_file: PathBuf,
    /// The PEM private key.
    pub key_file: PathBuf,
}

impl CertificateFiles {
    /// Reads and checks both files.
    pub fn load(&self) -> Result<LoadedCertificate, CertificateError> {
        load(&self.cert_file, &self.key_file, &provider())
    }
}
