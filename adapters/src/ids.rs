//! Identifier generation for Responses items (`msg_`, `fc_`, `fco_`, `rs_`, `call_` + random hex).

/// A new identifier: `prefix` followed by 48 random hex digits (e.g. `msg_3f2a...`).
pub fn new_item_id(prefix: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + 48);
    id.push_str(prefix);
    for _ in 0..3 {
        id.push_str(&format!("{:016x}", fastrand::u64(..)));
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_prefix_and_differ() {
        let a = new_item_id("msg_");
        let b = new_item_id("msg_");
        assert!(a.starts_with("msg_"));
        assert_eq!(a.len(), 4 + 48);
        assert_ne!(a, b);
    }
}
