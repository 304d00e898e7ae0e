//! Gives the drop-in library rdma-core's symbol versions (`IBVERBS_1.0` .. `IBVERBS_1.13`,
//! `EFA_1.0` .. `EFA_1.3`): the version nodes come from `efa-emu.map`; `src/exports.rs` binds
//! each exported function to its version with `.symver`.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=efa-emu.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/efa-emu.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
}
