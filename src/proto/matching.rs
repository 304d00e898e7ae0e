//! Receive matching: posted and unexpected queues, tags with ignore bits, directed receives
//! (libfabric's `util_srx` rules).
//!
//! Untagged receives match the oldest posted untagged receive whose source filter admits the
//! sender. Tagged receives match when `(recv_tag | ignore) == (tag | ignore)`. Posting order is
//! kept across any-source and directed receives (one queue per kind).
//!
//! Unexpected messages are kept in arrival order and, when tagged, also indexed by tag: a
//! receive with an exact tag (no ignore bits, the common case) finds its message without walking
//! past the messages of other tags, so one peer flooding a tag no receive asks for does not slow
//! every other receive down (issue 17, defect 2). A receive with ignore bits walks the arrival
//! order, as libfabric does.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// libfabric's `ofi_match_tag`.
pub fn tag_matches(recv_tag: u64, ignore: u64, tag: u64) -> bool {
    (recv_tag | ignore) == (tag | ignore)
}

/// A posted receive.
#[derive(Debug)]
pub struct Posted<S, R> {
    /// Only messages from this source (directed receive), or any.
    pub src: Option<S>,
    /// The tag (tagged receives).
    pub tag: u64,
    /// Bits of the tag to ignore.
    pub ignore: u64,
    /// The receive itself.
    pub item: R,
}

/// A message that arrived before a matching receive was posted.
#[derive(Debug)]
pub struct Unexpected<S, U> {
    /// Sender.
    pub src: S,
    /// Tag (0 for untagged).
    pub tag: u64,
    /// The message.
    pub item: U,
}

/// Posted and unexpected queues for untagged and tagged messages.
#[derive(Debug)]
pub struct Matcher<S, R, U> {
    posted: [VecDeque<Posted<S, R>>; 2],
    unexpected: [Unexpecteds<S, U>; 2],
}

impl<S, R, U> Default for Matcher<S, R, U> {
    fn default() -> Self {
        Matcher {
            posted: [VecDeque::new(), VecDeque::new()],
            unexpected: [Unexpecteds::default(), Unexpecteds::default()],
        }
    }
}

/// Unexpected messages by arrival number, and the arrival numbers of each tag.
#[derive(Debug)]
struct Unexpecteds<S, U> {
    items: BTreeMap<usize, Unexpected<S, U>>,
    by_tag: HashMap<u64, VecDeque<usize>>,
    next: usize,
}

impl<S, U> Default for Unexpecteds<S, U> {
    fn default() -> Self {
        Unexpecteds {
            items: BTreeMap::new(),
            by_tag: HashMap::new(),
            next: 0,
        }
    }
}

impl<S, U> Unexpecteds<S, U> {
    /// Queues `u`; `index`: also under its tag (tagged messages; untagged ones match by arrival
    /// order alone).
    fn push(&mut self, u: Unexpected<S, U>, index: bool) {
        let key = self.next;
        self.next += 1;
        if index {
            self.by_tag.entry(u.tag).or_default().push_back(key);
        }
        self.items.insert(key, u);
    }

    fn take(&mut self, key: usize) -> Option<Unexpected<S, U>> {
        let u = self.items.remove(&key)?;
        if let Some(q) = self.by_tag.get_mut(&u.tag) {
            if q.front() == Some(&key) {
                q.pop_front();
            } else if let Some(i) = q.iter().position(|&k| k == key) {
                q.remove(i);
            }
            if q.is_empty() {
                self.by_tag.remove(&u.tag);
            }
        }
        Some(u)
    }
}

impl<S: Copy + Eq, R, U> Matcher<S, R, U> {
    /// Queues a posted receive (after checking the unexpected queue with [`Self::find_unexpected`]).
    pub fn post(&mut self, tagged: bool, p: Posted<S, R>) {
        self.posted[usize::from(tagged)].push_back(p);
    }

    /// The first posted receive an arriving message from `src` with `tag` matches.
    pub fn find_posted(&self, tagged: bool, src: S, tag: u64) -> Option<usize> {
        self.posted[usize::from(tagged)].iter().position(|p| {
            p.src.is_none_or(|s| s == src) && (!tagged || tag_matches(p.tag, p.ignore, tag))
        })
    }

    /// The posted receive at `idx`.
    pub fn posted_mut(&mut self, tagged: bool, idx: usize) -> Option<&mut Posted<S, R>> {
        self.posted[usize::from(tagged)].get_mut(idx)
    }

    /// Removes the posted receive at `idx`.
    pub fn take_posted(&mut self, tagged: bool, idx: usize) -> Option<Posted<S, R>> {
        self.posted[usize::from(tagged)].remove(idx)
    }

    /// Removes the first posted receive for which `pred` holds (cancel).
    pub fn cancel_posted(
        &mut self,
        mut pred: impl FnMut(&R) -> bool,
    ) -> Option<(bool, Posted<S, R>)> {
        for tagged in [false, true] {
            let q = &mut self.posted[usize::from(tagged)];
            if let Some(i) = q.iter().position(|p| pred(&p.item)) {
                return q.remove(i).map(|p| (tagged, p));
            }
        }
        None
    }

    /// Drains every posted receive (endpoint close).
    pub fn drain_posted(&mut self) -> Vec<(bool, Posted<S, R>)> {
        let mut v: Vec<_> = self.posted[0].drain(..).map(|p| (false, p)).collect();
        v.extend(self.posted[1].drain(..).map(|p| (true, p)));
        v
    }

    /// Queues an unexpected message.
    pub fn push_unexpected(&mut self, tagged: bool, u: Unexpected<S, U>) {
        self.unexpected[usize::from(tagged)].push(u, tagged);
    }

    /// The oldest unexpected message a receive (`src` filter, `tag`, `ignore`) matches: its
    /// key (stable until it is taken).
    pub fn find_unexpected(
        &self,
        tagged: bool,
        src: Option<S>,
        tag: u64,
        ignore: u64,
    ) -> Option<usize> {
        let q = &self.unexpected[usize::from(tagged)];
        if q.items.is_empty() {
            return None;
        }
        let from = |u: &Unexpected<S, U>| src.is_none_or(|s| s == u.src);
        if tagged && ignore == 0 {
            // An exact tag: only that tag's messages, in arrival order.
            return q
                .by_tag
                .get(&tag)?
                .iter()
                .copied()
                .find(|k| q.items.get(k).is_some_and(from));
        }
        q.items
            .iter()
            .find(|(_, u)| from(u) && (!tagged || tag_matches(tag, ignore, u.tag)))
            .map(|(&k, _)| k)
    }

    /// The key of the oldest unexpected message for which `pred` holds.
    pub fn position_unexpected(
        &self,
        tagged: bool,
        mut pred: impl FnMut(&Unexpected<S, U>) -> bool,
    ) -> Option<usize> {
        self.unexpected[usize::from(tagged)]
            .items
            .iter()
            .find(|(_, u)| pred(u))
            .map(|(&k, _)| k)
    }

    /// The unexpected message with key `key`.
    pub fn unexpected(&self, tagged: bool, key: usize) -> Option<&Unexpected<S, U>> {
        self.unexpected[usize::from(tagged)].items.get(&key)
    }

    /// The unexpected message with key `key`, mutably (its tag must not change).
    pub fn unexpected_mut(&mut self, tagged: bool, key: usize) -> Option<&mut Unexpected<S, U>> {
        self.unexpected[usize::from(tagged)].items.get_mut(&key)
    }

    /// Removes the unexpected message with key `key`.
    pub fn take_unexpected(&mut self, tagged: bool, key: usize) -> Option<Unexpected<S, U>> {
        self.unexpected[usize::from(tagged)].take(key)
    }

    /// Number of unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected[0].items.len() + self.unexpected[1].items.len()
    }

    /// Number of posted receives.
    pub fn posted_len(&self) -> usize {
        self.posted[0].len() + self.posted[1].len()
    }

    /// Removes unexpected messages for which `pred` holds (peer teardown).
    pub fn remove_unexpected_where(
        &mut self,
        mut pred: impl FnMut(&Unexpected<S, U>) -> bool,
    ) -> Vec<U> {
        let mut out = Vec::new();
        for q in &mut self.unexpected {
            let keys: Vec<usize> = q
                .items
                .iter()
                .filter(|(_, u)| pred(u))
                .map(|(&k, _)| k)
                .collect();
            for k in keys {
                out.extend(q.take(k).map(|u| u.item));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_rule() {
        assert!(tag_matches(0x12, 0, 0x12));
        assert!(!tag_matches(0x12, 0, 0x13));
        assert!(tag_matches(0x10, 0x0f, 0x1f));
        assert!(!tag_matches(0x10, 0x0f, 0x2f));
    }

    #[test]
    fn posting_order_directed_and_any_source() {
        let mut m: Matcher<u32, &str, ()> = Matcher::default();
        m.post(
            true,
            Posted {
                src: Some(2),
                tag: 5,
                ignore: 0,
                item: "from 2",
            },
        );
        m.post(
            true,
            Posted {
                src: None,
                tag: 5,
                ignore: 0,
                item: "any",
            },
        );
        m.post(
            false,
            Posted {
                src: None,
                tag: 0,
                ignore: 0,
                item: "untagged",
            },
        );
        // A message from 1 skips the directed receive.
        let i = m.find_posted(true, 1, 5).unwrap();
        assert_eq!(m.take_posted(true, i).unwrap().item, "any");
        // From 2 it takes the directed one; tag 6 matches nothing.
        assert!(m.find_posted(true, 2, 6).is_none());
        let i = m.find_posted(true, 2, 5).unwrap();
        assert_eq!(m.take_posted(true, i).unwrap().item, "from 2");
        assert_eq!(
            m.find_posted(false, 9, 123),
            Some(0),
            "untagged ignores tags"
        );
    }

    #[test]
    fn unexpected_in_arrival_order_with_filters() {
        let mut m: Matcher<u32, (), u32> = Matcher::default();
        for (k, (src, tag)) in [(1, 0x100), (2, 0x101), (1, 0x102)].into_iter().enumerate() {
            m.push_unexpected(
                true,
                Unexpected {
                    src,
                    tag,
                    item: k as u32,
                },
            );
        }
        assert_eq!(m.find_unexpected(true, None, 0x100, 0xff), Some(0));
        assert_eq!(m.find_unexpected(true, Some(2), 0x100, 0xff), Some(1));
        assert_eq!(m.find_unexpected(true, Some(1), 0x102, 0), Some(2));
        assert_eq!(m.find_unexpected(true, Some(3), 0, u64::MAX), None);
        assert_eq!(m.remove_unexpected_where(|u| u.src == 1), vec![0, 2]);
        assert_eq!(m.unexpected_len(), 1);
    }
}
