fn main() {
    let idx: u32 = std::env::args().nth(1).unwrap().parse().unwrap();
    println!("host {:?}", shareguard_limiter_net::rtnl::link_packets(idx));
    println!("peer {:?}", shareguard_limiter_net::rtnl::peer_packets(idx));
}
