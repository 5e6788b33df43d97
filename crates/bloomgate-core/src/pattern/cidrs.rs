//! Address ranges (CIDRs) as the config lists them (trusted proxies, the clients that see
//! the outcome header, budget exemptions), compiled once and asked per request whether
//! they hold an address. It does not decide who the client is (see `pipeline::client`).

use std::net::IpAddr;

use ipnet::IpNet;

/// A list of address ranges (CIDRs), compiled once from the config.
#[derive(Debug, Clone, Default)]
pub struct Cidrs {
    nets: Vec<IpNet>,
}

/// An entry of an address list that is neither an address nor a range; carries the
/// entry and why it is not a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{entry}` is neither an address nor a CIDR range (a.b.c.d/n)")]
pub struct BadCidr {
    /// The entry as configured (trimmed).
    pub entry: String,
    /// Why it does not parse as a range.
    #[source]
    pub source: ipnet::AddrParseError,
}

impl Cidrs {
    /// Parses `a.b.c.d/n`, `x::/n` or a bare address (a /32 or /128). The error names the
    /// entry that could not be read.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Cidrs, BadCidr> {
        let mut nets = Vec::with_capacity(entries.len());
        for entry in entries {
            let s = entry.as_ref().trim();
            let net = match s.parse::<IpNet>() {
                Ok(net) => net.trunc(),
                Err(source) => match s.parse::<IpAddr>() {
                    Ok(ip) => IpNet::from(ip),
                    Err(_) => {
                        return Err(BadCidr {
                            entry: s.to_owned(),
                            source,
                        });
                    }
                },
            };
            nets.push(net);
        }
        Ok(Cidrs { nets })
    }

    /// Whether no range is configured.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }

    /// Whether `ip` falls in one of the ranges. IPv4-mapped IPv6 addresses
    /// (`::ffff:a.b.c.d`, what a dual-stack listener reports) are matched as IPv4.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical_ip(ip);
        self.nets.iter().any(|n| n.contains(&ip))
    }
}

/// `::ffff:a.b.c.d` as `a.b.c.d`; any other address unchanged.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}
