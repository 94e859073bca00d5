//! Raw TCP rules made local in a sandbox's own network namespace: `ip route add local <range> dev
//! lo` for each rule's range, through one NETLINK_ROUTE socket.
//!
//! A sandbox's network namespace has `lo` and nothing else, so a `connect()` to an address outside
//! every such range finds no route (ENETUNREACH); one inside is delivered to this namespace's own
//! listeners, which the caller binds on the rules' ports (`0.0.0.0:<port>`, `[::]:<port>`): the
//! accepted socket's local address is the destination the command asked for. Both the daemon
//! (local backend, on a thread that entered the sandbox's namespace) and the container's
//! supervisor (its own namespace) call [`add_local_routes`].
//!
//! Blocking and thread-local on purpose: the socket belongs to the namespace of the thread that
//! creates it, so it is made, used and closed within the call.

use std::net::IpAddr;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// The kernel's `local` routing table (RT_TABLE_LOCAL), where `ip route add local` puts a route.
const RT_TABLE_LOCAL: u8 = 255;

/// The `RTM_NEWROUTE` of one local range on interface `lo_index`.
fn local_route(addr: IpAddr, prefix: u8, lo_index: u32) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header = RouteHeader {
        address_family: if addr.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        },
        destination_prefix_length: prefix,
        table: RT_TABLE_LOCAL,
        protocol: RouteProtocol::Boot,
        scope: RouteScope::Host,
        kind: RouteType::Local,
        ..Default::default()
    };
    msg.attributes = vec![
        RouteAttribute::Destination(RouteAddress::from(addr)),
        RouteAttribute::Oif(lo_index),
        RouteAttribute::Table(u32::from(RT_TABLE_LOCAL)),
    ];
    msg
}

/// Adds a local route on `lo` for every `(address, prefix)` range (duplicates once), in the
/// calling thread's network namespace. Needs CAP_NET_ADMIN over that namespace. An error names
/// the range and the kernel's answer.
pub fn add_local_routes(ranges: &[(IpAddr, u8)]) -> Result<(), String> {
    let mut unique: Vec<(IpAddr, u8)> = Vec::new();
    for r in ranges {
        if !unique.contains(r) {
            unique.push(*r);
        }
    }
    if unique.is_empty() {
        return Ok(());
    }
    let lo = nix::net::if_::if_nametoindex("lo")
        .map_err(|e| format!("local routes: no loopback interface: {}", e.desc()))?;
    let mut socket =
        Socket::new(NETLINK_ROUTE).map_err(|e| format!("local routes: netlink socket: {e}"))?;
    socket
        .bind_auto()
        .and_then(|_| socket.connect(&SocketAddr::new(0, 0)))
        .map_err(|e| format!("local routes: netlink socket: {e}"))?;
    let mut reply = vec![0u8; 8192];
    for (seq, (addr, prefix)) in unique.iter().enumerate() {
        let what = format!("local route {addr}/{prefix} on lo");
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK;
        header.sequence_number = seq as u32 + 1;
        let mut msg = NetlinkMessage::new(
            header,
            NetlinkPayload::from(RouteNetlinkMessage::NewRoute(local_route(
                *addr, *prefix, lo,
            ))),
        );
        msg.finalize();
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut buf);
        socket
            .send(&buf, 0)
            .map_err(|e| format!("{what}: sending the request: {e}"))?;
        // One answer per request: its ACK or its error.
        let n = socket
            .recv(&mut &mut reply[..], 0)
            .map_err(|e| format!("{what}: reading the answer: {e}"))?;
        let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[..n])
            .map_err(|e| format!("{what}: unreadable answer: {e}"))?;
        match answer.payload {
            NetlinkPayload::Error(e) if e.code.is_none() => {}
            NetlinkPayload::Error(e) => return Err(format!("{what}: {}", e.to_io())),
            other => {
                return Err(format!(
                    "{what}: unexpected answer (type {})",
                    other.message_type()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::{Emitable, Parseable};

    /// The message is what `ip route add local 10.20.0.0/16 dev lo` sends: RTN_LOCAL, scope host,
    /// table local, the destination and the interface.
    #[test]
    fn a_local_route_message_round_trips() {
        let msg = local_route("10.20.0.0".parse().unwrap(), 16, 1);
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.emit(&mut buf);
        let back = RouteMessage::parse(&buf[..]).unwrap();
        assert_eq!(back.header.kind, RouteType::Local);
        assert_eq!(back.header.scope, RouteScope::Host);
        assert_eq!(back.header.table, RT_TABLE_LOCAL);
        assert_eq!(back.header.destination_prefix_length, 16);
        assert!(back.attributes.contains(&RouteAttribute::Oif(1)));
        assert!(
            back.attributes
                .contains(&RouteAttribute::Destination(RouteAddress::Inet(
                    "10.20.0.0".parse().unwrap()
                )))
        );
        let v6 = local_route("2001:db8::".parse().unwrap(), 32, 1);
        assert_eq!(v6.header.address_family, AddressFamily::Inet6);
    }

    /// Needs root (CAP_SYS_ADMIN for the namespace): in a fresh network namespace of its own
    /// thread, a range made local reaches a listener there with the asked-for address as its
    /// local address; an address outside it has no route.
    #[test]
    fn as_root_local_routes_deliver_to_listeners_and_nothing_else_routes() {
        std::thread::spawn(|| {
            // SAFETY: unshare(2) with CLONE_NEWNET moves only this thread to a new namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                panic!(
                    "this test needs root: unshare(CLONE_NEWNET): {}",
                    std::io::Error::last_os_error()
                );
            }
            // A child forked from this thread runs in its namespace.
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .unwrap();
            assert!(up.success());
            add_local_routes(&[
                ("10.20.0.0".parse().unwrap(), 16),
                ("10.20.0.0".parse().unwrap(), 16),
            ])
            .unwrap();
            let l = std::net::TcpListener::bind("0.0.0.0:5432").unwrap();
            let c = std::net::TcpStream::connect("10.20.3.4:5432").unwrap();
            let (s, _) = l.accept().unwrap();
            assert_eq!(s.local_addr().unwrap(), "10.20.3.4:5432".parse().unwrap());
            assert_eq!(c.peer_addr().unwrap(), "10.20.3.4:5432".parse().unwrap());
            let e = std::net::TcpStream::connect("10.21.0.1:5432").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENETUNREACH), "{e}");
            let e = std::net::TcpStream::connect("10.20.3.4:5433").unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
            // IPv6 alike.
            add_local_routes(&[("2001:db8::".parse().unwrap(), 32)]).unwrap();
            let l6 = std::net::TcpListener::bind("[::]:5433").unwrap();
            let _c6 = std::net::TcpStream::connect("[2001:db8::7]:5433").unwrap();
            let (s6, _) = l6.accept().unwrap();
            assert_eq!(
                s6.local_addr().unwrap(),
                "[2001:db8::7]:5433".parse().unwrap()
            );
            let e = std::net::TcpStream::connect("[2001:db9::1]:5432").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENETUNREACH), "{e}");
            // The same range again is an error that names it.
            let e = add_local_routes(&[("10.20.0.0".parse().unwrap(), 16)]).unwrap_err();
            assert!(e.contains("10.20.0.0/16") && e.contains("exists"), "{e}");
        })
        .join()
        .unwrap();
    }
}
