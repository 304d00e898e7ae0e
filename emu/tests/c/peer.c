/* The libfabric side of emu/tests/c_interop.rs: libfabric's EFA provider (1.17, Debian's
 * libfabric-dev) on an emulated EFA NIC, talking to a Rust peer that uses the efa crate.
 *
 *   peer SEED SIZES        e.g.  peer 42 16,4096,65536,1048576,4194304
 *
 * Out of band, lines on stdout that start with '@' are for the Rust peer (the test harness relays
 * them to its stdin, and its '@' lines to ours); "RESULT ..." lines are the summary the test
 * parses; "FAIL ..." says what went wrong (exit status 1). Both sides derive every tag, size and
 * byte from SEED with the same generator (splitmix64), so each checks what it receives.
 *
 * Phases (the Rust peer runs the mirror image):
 *   1  tagged Rust -> C, three tags, ignore mask 0xff, half the receives posted late
 *   2  tagged C -> Rust, same
 *   3  untagged Rust -> C, FI_DELIVERY_COMPLETE with remote CQ data
 *   4  untagged C -> Rust, same
 *   5  RMA into the Rust peer's MemoryRegion: fi_write, fi_read, fi_writedata
 *   6  RMA by the Rust peer into our fi_mr_reg region: write, read, writedata (our CQ data)
 *   7  atomics into the Rust peer's region: fi_atomic, fi_fetch_atomic, fi_compare_atomic
 *   8  atomics by the Rust peer into our region
 *   9  messages to the old incarnation it never receives; it exits ("BYE"); av_remove
 *  10  a new Rust peer (new address): tagged C -> Rust, exactly these and nothing older
 *  11  tagged Rust (new) -> C
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#define GROUPS 3
#define TAG_BASE 0x7a00000000000000ULL
#define STALE_TAG 0x5ea1e00000000000ULL
#define MAX_MSGS 64
#define MAX_DONE 4096

static uint64_t seed;
static size_t sizes[16];
static int nsizes;
static size_t max_size;

static struct fi_info *info;
static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;
static fi_addr_t peer = FI_ADDR_UNSPEC;

static void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	printf("FAIL seed=%" PRIu64 ": ", seed);
	vprintf(fmt, ap);
	printf("\n");
	va_end(ap);
	fflush(stdout);
	exit(1);
}

#define CHECK(call)                                                                        \
	do {                                                                               \
		int rc_ = (int)(call);                                                     \
		if (rc_)                                                                   \
			fail("%s: %d (%s)", #call, rc_, fi_strerror(-rc_));                \
	} while (0)

/* ---- the generator both sides share ---- */

static uint64_t sm(uint64_t *x)
{
	uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

static uint64_t mix(uint64_t a, uint64_t b)
{
	uint64_t x = seed ^ (a * 0xD6E8FEB86659FD93ULL) ^ (b * 0xA0761D6478BD642FULL);
	return sm(&x);
}

static void fill(void *buf, size_t len, uint64_t s)
{
	uint8_t *p = buf;
	uint64_t x = s;
	for (size_t i = 0; i < len; i += 8) {
		uint64_t v = sm(&x);
		size_t n = len - i < 8 ? len - i : 8;
		for (size_t j = 0; j < n; j++)
			p[i + j] = (uint8_t)(v >> (8 * j));
	}
}

/* First differing byte, or -1. */
static long check(const void *buf, size_t len, uint64_t s)
{
	static uint8_t *want;
	static size_t cap;
	if (cap < len) {
		free(want);
		want = malloc(len);
		cap = len;
	}
	fill(want, len, s);
	const uint8_t *p = buf;
	for (size_t i = 0; i < len; i++)
		if (p[i] != want[i])
			return (long)i;
	return -1;
}

struct msg {
	size_t size;
	uint64_t tag;
	uint64_t ignore;
	uint64_t content;
};

/* The messages of a tagged phase: every size in every tag group, in size order. */
static int tagged_msgs(int phase, struct msg *m)
{
	int n = 0;
	for (int k = 0; k < nsizes; k++)
		for (int g = 0; g < GROUPS; g++, n++) {
			m[n].size = sizes[k];
			m[n].tag = TAG_BASE | ((uint64_t)phase << 16) | ((uint64_t)g << 8) |
				   (mix(phase, 1000 + n) & 0xff);
			m[n].ignore = 0xff;
			m[n].content = mix(phase, n);
		}
	return n;
}

/* ---- completions ---- */

struct done {
	uint64_t id;
	uint64_t flags;
	size_t len;
	uint64_t tag;
	uint64_t data;
};

static struct done dones[MAX_DONE];
static int ndone;

/* Contexts are small integers cast to pointers (the RDM provider asks for no FI_CONTEXT). */
#define CTX(id) ((void *)(uintptr_t)(id))

static void progress(void)
{
	struct fi_cq_tagged_entry e[16];
	for (;;) {
		ssize_t n = fi_cq_read(cq, e, 16);
		if (n == -FI_EAGAIN)
			return;
		if (n == -FI_EAVAIL) {
			struct fi_cq_err_entry err = {0};
			fi_cq_readerr(cq, &err, 0);
			fail("error completion: ctx %lu err %d (%s) prov_errno %d (%s) flags 0x%lx",
			     (unsigned long)(uintptr_t)err.op_context, err.err, fi_strerror(err.err),
			     err.prov_errno,
			     fi_cq_strerror(cq, err.prov_errno, err.err_data, NULL, 0),
			     (unsigned long)err.flags);
		}
		if (n < 0)
			fail("fi_cq_read: %zd", n);
		for (ssize_t i = 0; i < n; i++) {
			if (ndone == MAX_DONE)
				fail("too many completions");
			dones[ndone++] = (struct done){
			    .id = (uint64_t)(uintptr_t)e[i].op_context,
			    .flags = e[i].flags,
			    .len = e[i].len,
			    .tag = e[i].tag,
			    .data = e[i].data,
			};
		}
	}
}

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Takes the completion whose context is `id` (remote writes: id 0 and the data), waiting. */
static struct done take(uint64_t id, const char *what)
{
	double deadline = now_s() + 60;
	for (;;) {
		progress();
		for (int i = 0; i < ndone; i++)
			if (dones[i].id == id) {
				struct done d = dones[i];
				dones[i] = dones[--ndone];
				return d;
			}
		if (now_s() > deadline)
			fail("no completion for %s (context %lu) within 60 s", what,
			     (unsigned long)id);
	}
}

/* ---- out of band: lines through the harness ---- */

static void say(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	printf("@");
	vprintf(fmt, ap);
	printf("\n");
	fflush(stdout);
	va_end(ap);
}

static char inbuf[1 << 16];
static size_t inlen;

/* A line from the peer if one is complete (without its newline), else NULL; never blocks. */
static char *try_line(void)
{
	static char line[1 << 16];
	for (;;) {
		char *nl = memchr(inbuf, '\n', inlen);
		if (nl) {
			size_t n = (size_t)(nl - inbuf);
			memcpy(line, inbuf, n);
			line[n] = 0;
			memmove(inbuf, nl + 1, inlen - n - 1);
			inlen -= n + 1;
			return line;
		}
		struct pollfd p = {.fd = 0, .events = POLLIN};
		if (poll(&p, 1, 0) <= 0)
			return NULL;
		ssize_t r = read(0, inbuf + inlen, sizeof(inbuf) - inlen);
		if (r <= 0)
			fail("stdin closed");
		inlen += (size_t)r;
	}
}

/* Waits for the next line, which must start with `prefix`; drives the endpoint meanwhile. */
static char *expect_line(const char *prefix)
{
	double deadline = now_s() + 120;
	for (;;) {
		progress();
		char *l = try_line();
		if (l) {
			if (strncmp(l, prefix, strlen(prefix)) != 0)
				fail("expected a line \"%s...\", got \"%s\"", prefix, l);
			return l + strlen(prefix);
		}
		if (now_s() > deadline)
			fail("no line \"%s\" within 120 s", prefix);
		usleep(10);
	}
}

/* ---- memory ---- */

struct region {
	uint8_t *buf;
	size_t len;
	struct fid_mr *mr;
	void *desc;
};

static struct region reg(size_t len, uint64_t access)
{
	struct region r = {.len = len};
	if (posix_memalign((void **)&r.buf, 4096, len ? len : 1))
		fail("out of memory");
	memset(r.buf, 0, len);
	CHECK(fi_mr_reg(domain, r.buf, len, access, 0, 0, 0, &r.mr, NULL));
	r.desc = fi_mr_desc(r.mr);
	return r;
}

static void unreg(struct region *r)
{
	fi_close(&r->mr->fid);
	free(r->buf);
}

#define LOCAL_ACCESS (FI_SEND | FI_RECV | FI_READ | FI_WRITE)

/* Retries a post while the provider says -FI_EAGAIN. */
#define POST(call)                                                                         \
	do {                                                                               \
		ssize_t rc_;                                                               \
		double dl_ = now_s() + 60;                                                 \
		while ((rc_ = (call)) == -FI_EAGAIN) {                                     \
			progress();                                                        \
			if (now_s() > dl_)                                                 \
				fail("%s: -FI_EAGAIN for 60 s", #call);                    \
		}                                                                          \
		if (rc_)                                                                   \
			fail("%s: %zd (%s)", #call, rc_, fi_strerror((int)-rc_));          \
	} while (0)

/* ---- address exchange ---- */

static void send_addr(void)
{
	uint8_t a[64];
	size_t alen = sizeof(a);
	CHECK(fi_getname(&ep->fid, a, &alen));
	char hex[129];
	for (size_t i = 0; i < alen; i++)
		sprintf(hex + 2 * i, "%02x", a[i]);
	say("ADDR %s", hex);
}

static void recv_addr(void)
{
	char *hex = expect_line("ADDR ");
	uint8_t a[64] = {0};
	size_t n = strlen(hex) / 2;
	if (n > sizeof(a))
		fail("address too long");
	for (size_t i = 0; i < n; i++)
		sscanf(hex + 2 * i, "%2hhx", &a[i]);
	if (fi_av_insert(av, a, 1, &peer, 0, NULL) != 1)
		fail("fi_av_insert of the Rust peer's address failed");
}

/* ---- phases ---- */

static uint64_t total_bytes;

static void check_recv_completion(int phase, int i, struct done d, const struct msg *m,
				  uint64_t want_flags)
{
	if (d.len != m->size || d.tag != m->tag || (d.flags & want_flags) != want_flags)
		fail("phase %d: receive %d: len %zu tag 0x%lx flags 0x%lx, expected len %zu tag "
		     "0x%lx flags 0x%lx",
		     phase, i, d.len, (unsigned long)d.tag, (unsigned long)d.flags, m->size,
		     (unsigned long)m->tag, (unsigned long)want_flags);
}

/* Receives a tagged phase: half the receives before the sender starts, half after; checks
 * every completion (length, exact tag, flags) and what each receive got (its order in its group). */
static void tagged_recv(int phase)
{
	struct msg m[MAX_MSGS];
	int n = tagged_msgs(phase, m);
	size_t total = 0, off[MAX_MSGS];
	for (int i = 0; i < n; i++) {
		off[i] = total;
		total += m[i].size;
	}
	struct region r = reg(total, LOCAL_ACCESS);
	int first = n / 2;
	for (int i = 0; i < first; i++)
		POST(fi_trecv(ep, r.buf + off[i], m[i].size, r.desc, FI_ADDR_UNSPEC,
			      m[i].tag & ~m[i].ignore, m[i].ignore, CTX(1000 + i)));
	say("POSTED %d", phase);
	for (int i = 0; i < first; i++)
		check_recv_completion(phase, i, take(1000 + i, "tagged receive"), &m[i],
				      FI_TAGGED | FI_RECV);
	for (int i = first; i < n; i++)
		POST(fi_trecv(ep, r.buf + off[i], m[i].size, r.desc, FI_ADDR_UNSPEC,
			      m[i].tag & ~m[i].ignore, m[i].ignore, CTX(1000 + i)));
	for (int i = first; i < n; i++)
		check_recv_completion(phase, i, take(1000 + i, "tagged receive"), &m[i],
				      FI_TAGGED | FI_RECV);
	for (int i = 0; i < n; i++) {
		long bad = check(r.buf + off[i], m[i].size, m[i].content);
		if (bad >= 0)
			fail("phase %d: message %d (%zu bytes, tag 0x%lx) differs at byte %ld", phase,
			     i, m[i].size, (unsigned long)m[i].tag, bad);
		total_bytes += m[i].size;
	}
	unreg(&r);
	say("RECVD %d", phase);
	printf("RESULT phase=%d tagged_recv count=%d\n", phase, n);
}

static void tagged_send(int phase)
{
	struct msg m[MAX_MSGS];
	int n = tagged_msgs(phase, m);
	size_t total = 0, off[MAX_MSGS];
	for (int i = 0; i < n; i++) {
		off[i] = total;
		total += m[i].size;
	}
	struct region r = reg(total, LOCAL_ACCESS);
	for (int i = 0; i < n; i++)
		fill(r.buf + off[i], m[i].size, m[i].content);
	expect_line("POSTED ");
	for (int i = 0; i < n; i++)
		POST(fi_tsend(ep, r.buf + off[i], m[i].size, r.desc, peer, m[i].tag,
			      CTX(2000 + i)));
	for (int i = 0; i < n; i++) {
		struct done d = take(2000 + i, "tagged send");
		if (!(d.flags & FI_SEND))
			fail("phase %d: send %d completion flags 0x%lx", phase, i,
			     (unsigned long)d.flags);
	}
	expect_line("RECVD ");
	unreg(&r);
	printf("RESULT phase=%d tagged_send count=%d\n", phase, n);
}

/* Untagged delivery-complete messages with remote CQ data: one per size. */
static void dc_recv(int phase)
{
	size_t off[16], total = 0;
	for (int k = 0; k < nsizes; k++) {
		off[k] = total;
		total += sizes[k];
	}
	struct region r = reg(total, LOCAL_ACCESS);
	for (int k = 0; k < nsizes; k++)
		POST(fi_recv(ep, r.buf + off[k], sizes[k], r.desc, FI_ADDR_UNSPEC, CTX(3000 + k)));
	say("POSTED %d", phase);
	for (int k = 0; k < nsizes; k++) {
		struct done d = take(3000 + k, "dc receive");
		uint64_t want = FI_MSG | FI_RECV | FI_REMOTE_CQ_DATA;
		if (d.len != sizes[k] || (d.flags & want) != want ||
		    d.data != ((uint64_t)phase << 16 | (uint64_t)k))
			fail("phase %d: receive %d: len %zu flags 0x%lx data 0x%lx", phase, k, d.len,
			     (unsigned long)d.flags, (unsigned long)d.data);
		long bad = check(r.buf + off[k], sizes[k], mix(phase, k));
		if (bad >= 0)
			fail("phase %d: message %d (%zu bytes) differs at byte %ld", phase, k,
			     sizes[k], bad);
		total_bytes += sizes[k];
	}
	unreg(&r);
	say("RECVD %d", phase);
	printf("RESULT phase=%d dc_recv count=%d\n", phase, nsizes);
}

static void dc_send(int phase)
{
	size_t off[16], total = 0;
	for (int k = 0; k < nsizes; k++) {
		off[k] = total;
		total += sizes[k];
	}
	struct region r = reg(total, LOCAL_ACCESS);
	for (int k = 0; k < nsizes; k++)
		fill(r.buf + off[k], sizes[k], mix(phase, k));
	expect_line("POSTED ");
	for (int k = 0; k < nsizes; k++) {
		struct iovec iov = {.iov_base = r.buf + off[k], .iov_len = sizes[k]};
		void *desc = r.desc;
		struct fi_msg msg = {
		    .msg_iov = &iov,
		    .desc = &desc,
		    .iov_count = 1,
		    .addr = peer,
		    .context = CTX(4000 + k),
		    .data = (uint64_t)phase << 16 | (uint64_t)k,
		};
		POST(fi_sendmsg(ep, &msg, FI_DELIVERY_COMPLETE | FI_REMOTE_CQ_DATA | FI_COMPLETION));
	}
	for (int k = 0; k < nsizes; k++)
		take(4000 + k, "dc send");
	expect_line("RECVD ");
	unreg(&r);
	printf("RESULT phase=%d dc_send count=%d\n", phase, nsizes);
}

/* RMA into the Rust peer's region: write, read back, writedata into its second half. */
static void rma_initiator(int phase)
{
	uint64_t addr, key, len;
	char *l = expect_line("RKEY ");
	if (sscanf(l, "%" SCNx64 " %" SCNx64 " %" SCNx64, &addr, &key, &len) != 3)
		fail("bad RKEY line %s", l);
	if (len < 2 * max_size)
		fail("remote region too small: %lu", (unsigned long)len);
	struct region src = reg(max_size, LOCAL_ACCESS);
	struct region dst = reg(max_size, LOCAL_ACCESS);
	for (int k = 0; k < nsizes; k++) {
		size_t s = sizes[k];
		fill(src.buf, s, mix(phase, k));
		/* Delivery complete: the read below must see the bytes (FI_TRANSMIT_COMPLETE
		 * does not order a later read after them). */
		struct iovec iov = {.iov_base = src.buf, .iov_len = s};
		struct fi_rma_iov rma = {.addr = addr, .len = s, .key = key};
		struct fi_msg_rma wmsg = {
		    .msg_iov = &iov,
		    .desc = &src.desc,
		    .iov_count = 1,
		    .addr = peer,
		    .rma_iov = &rma,
		    .rma_iov_count = 1,
		    .context = CTX(5000),
		};
		POST(fi_writemsg(ep, &wmsg, FI_DELIVERY_COMPLETE | FI_COMPLETION));
		take(5000, "fi_write");
		memset(dst.buf, 0, s);
		POST(fi_read(ep, dst.buf, s, dst.desc, peer, addr, key, CTX(5001)));
		struct done d = take(5001, "fi_read");
		if (!(d.flags & FI_READ))
			fail("fi_read completion flags 0x%lx", (unsigned long)d.flags);
		long bad = check(dst.buf, s, mix(phase, k));
		if (bad >= 0)
			fail("phase %d: fi_read of %zu bytes differs at byte %ld", phase, s, bad);
		fill(src.buf, s, mix(phase, 100 + k));
		POST(fi_writedata(ep, src.buf, s, src.desc, (uint64_t)phase << 16 | (uint64_t)k,
				  peer, addr + max_size, key, CTX(5002)));
		take(5002, "fi_writedata");
		say("WROTE %d", k);
		expect_line("CHECKED ");
		total_bytes += 3 * s;
	}
	unreg(&src);
	unreg(&dst);
	printf("RESULT phase=%d rma_initiator sizes=%d\n", phase, nsizes);
}

static struct region target;

static void rma_target(int phase)
{
	target = reg(2 * max_size, LOCAL_ACCESS | FI_REMOTE_READ | FI_REMOTE_WRITE);
	say("CKEY %lx %lx %lx", (unsigned long)(uintptr_t)target.buf,
	    (unsigned long)fi_mr_key(target.mr), (unsigned long)target.len);
	for (int k = 0; k < nsizes; k++) {
		size_t s = sizes[k];
		expect_line("WROTE ");
		/* The writedata's completion: FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA. */
		struct done d;
		double deadline = now_s() + 60;
		for (;;) {
			if (now_s() > deadline)
				fail("phase %d: no remote write completion within 60 s", phase);
			progress();
			int i;
			for (i = 0; i < ndone; i++)
				if (dones[i].flags & FI_REMOTE_WRITE)
					break;
			if (i < ndone) {
				d = dones[i];
				dones[i] = dones[--ndone];
				break;
			}
		}
		uint64_t want = FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA;
		if ((d.flags & want) != want || d.data != ((uint64_t)phase << 16 | (uint64_t)k))
			fail("phase %d: remote write completion flags 0x%lx data 0x%lx len %zu",
			     phase, (unsigned long)d.flags, (unsigned long)d.data, d.len);
		long bad = check(target.buf, s, mix(phase, k));
		if (bad >= 0)
			fail("phase %d: written %zu bytes differ at byte %ld", phase, s, bad);
		bad = check(target.buf + max_size, s, mix(phase, 100 + k));
		if (bad >= 0)
			fail("phase %d: writedata of %zu bytes differs at byte %ld", phase, s, bad);
		say("CHECKED %d", k);
		total_bytes += 3 * s;
	}
	printf("RESULT phase=%d rma_target sizes=%d\n", phase, nsizes);
}

#define NATOM 8

static uint64_t atom_init(int phase, int j) { return mix(phase, 200 + j) >> 8; }

static void atomic_initiator(int phase)
{
	uint64_t addr, key, len;
	char *l = expect_line("ATOM ");
	if (sscanf(l, "%" SCNx64 " %" SCNx64 " %" SCNx64, &addr, &key, &len) != 3)
		fail("bad ATOM line %s", l);
	size_t count;
	CHECK(fi_atomicvalid(ep, FI_UINT64, FI_SUM, &count));
	CHECK(fi_fetch_atomicvalid(ep, FI_UINT64, FI_SUM, &count));
	CHECK(fi_compare_atomicvalid(ep, FI_UINT64, FI_CSWAP, &count));
	struct region b = reg(4 * NATOM * 8, LOCAL_ACCESS);
	uint64_t *op = (uint64_t *)b.buf, *res = op + NATOM, *cmp = res + NATOM;
	uint64_t v[NATOM];
	for (int j = 0; j < NATOM; j++)
		v[j] = atom_init(phase, j);
	/* fi_atomic SUM on all eight. */
	for (int j = 0; j < NATOM; j++)
		op[j] = j + 1;
	POST(fi_atomic(ep, op, NATOM, b.desc, peer, addr, key, FI_UINT64, FI_SUM, CTX(6000)));
	take(6000, "fi_atomic");
	for (int j = 0; j < NATOM; j++)
		v[j] += j + 1;
	/* fi_fetch_atomic SUM: the values before. */
	for (int j = 0; j < NATOM; j++)
		op[j] = 100 + j;
	POST(fi_fetch_atomic(ep, op, NATOM, b.desc, res, b.desc, peer, addr, key, FI_UINT64,
			     FI_SUM, CTX(6001)));
	take(6001, "fi_fetch_atomic");
	for (int j = 0; j < NATOM; j++) {
		if (res[j] != v[j])
			fail("fi_fetch_atomic: element %d fetched %lx, expected %lx", j,
			     (unsigned long)res[j], (unsigned long)v[j]);
		v[j] += 100 + j;
	}
	/* fi_compare_atomic CSWAP: the first four compare equal (swapped), the rest do not. */
	for (int j = 0; j < NATOM; j++) {
		cmp[j] = j < 4 ? v[j] : v[j] + 1;
		op[j] = mix(phase, 300 + j);
	}
	POST(fi_compare_atomic(ep, op, NATOM, b.desc, cmp, b.desc, res, b.desc, peer, addr, key,
			       FI_UINT64, FI_CSWAP, CTX(6002)));
	take(6002, "fi_compare_atomic");
	for (int j = 0; j < NATOM; j++) {
		if (res[j] != v[j])
			fail("fi_compare_atomic: element %d fetched %lx, expected %lx", j,
			     (unsigned long)res[j], (unsigned long)v[j]);
		if (j < 4)
			v[j] = op[j];
	}
	char line[NATOM * 17 + 1];
	for (int j = 0; j < NATOM; j++)
		sprintf(line + 16 * j, "%016lx", (unsigned long)v[j]);
	say("ATOMIC_DONE %s", line);
	expect_line("ATOMIC_CHECKED");
	unreg(&b);
	printf("RESULT phase=%d atomic_initiator ops=3\n", phase);
}

static void atomic_target(int phase)
{
	uint64_t *t = (uint64_t *)target.buf;
	for (int j = 0; j < NATOM; j++)
		t[j] = atom_init(phase, j);
	say("ATOM %lx %lx %lx", (unsigned long)(uintptr_t)target.buf,
	    (unsigned long)fi_mr_key(target.mr), (unsigned long)target.len);
	char *l = expect_line("ATOMIC_DONE ");
	for (int j = 0; j < NATOM; j++) {
		uint64_t want;
		if (sscanf(l + 16 * j, "%16" SCNx64, &want) != 1)
			fail("bad ATOMIC_DONE line");
		if (t[j] != want)
			fail("phase %d: element %d is %lx after the peer's atomics, expected %lx",
			     phase, j, (unsigned long)t[j], (unsigned long)want);
	}
	say("ATOMIC_CHECKED");
	printf("RESULT phase=%d atomic_target elements=%d\n", phase, NATOM);
}

/* Messages the old incarnation never receives; then it says BYE and we forget it. */
static void stale(int phase)
{
	struct region r = reg(2 * 4096, LOCAL_ACCESS);
	fill(r.buf, 2 * 4096, mix(phase, 0));
	POST(fi_tsend(ep, r.buf, 16, r.desc, peer, STALE_TAG, CTX(7000)));
	POST(fi_tsend(ep, r.buf + 4096, 4096, r.desc, peer, STALE_TAG | 1, CTX(7001)));
	POST(fi_send(ep, r.buf, 64, r.desc, peer, CTX(7002)));
	take(7000, "stale send");
	take(7001, "stale send");
	take(7002, "stale send");
	say("STALE_SENT");
	expect_line("BYE");
	CHECK(fi_av_remove(av, &peer, 1, 0));
	peer = FI_ADDR_UNSPEC;
	unreg(&r);
	printf("RESULT phase=%d stale_sent count=3\n", phase);
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: %s SEED SIZES\n", argv[0]);
		return 2;
	}
	seed = strtoull(argv[1], NULL, 0);
	for (char *s = strtok(argv[2], ","); s && nsizes < 16; s = strtok(NULL, ",")) {
		sizes[nsizes] = strtoull(s, NULL, 0);
		if (sizes[nsizes] > max_size)
			max_size = sizes[nsizes];
		nsizes++;
	}
	if (nsizes * GROUPS > MAX_MSGS)
		fail("too many sizes");
	setvbuf(stdout, NULL, _IOLBF, 0);

	struct fi_info *hints = fi_allocinfo();
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_SEND | FI_RECV | FI_READ |
		      FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
	hints->domain_attr->mr_mode =
	    FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR;
	hints->tx_attr->msg_order = FI_ORDER_SAS;
	hints->rx_attr->msg_order = FI_ORDER_SAS;
	hints->fabric_attr->prov_name = strdup("efa");
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
	printf("INFO provider=%s domain=%s mr_mode=0x%x max_msg_size=%zu inject=%zu mode=0x%lx\n",
	       info->fabric_attr->prov_name, info->domain_attr->name, info->domain_attr->mr_mode,
	       info->ep_attr->max_msg_size, info->tx_attr->inject_size,
	       (unsigned long)info->mode);
	CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
	CHECK(fi_domain(fabric, info, &domain, NULL));
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 1024};
	CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL));
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	CHECK(fi_av_open(domain, &av_attr, &av, NULL));
	CHECK(fi_endpoint(domain, info, &ep, NULL));
	CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	CHECK(fi_ep_bind(ep, &av->fid, 0));
	CHECK(fi_enable(ep));

	double t0 = now_s();
	send_addr();
	recv_addr();
	tagged_recv(1);
	tagged_send(2);
	dc_recv(3);
	dc_send(4);
	rma_initiator(5);
	rma_target(6);
	atomic_initiator(7);
	atomic_target(8);
	stale(9);
	/* The new incarnation. */
	recv_addr();
	send_addr();
	tagged_send(10);
	tagged_recv(11);
	printf("RESULT done bytes=%lu seconds=%.1f\n", (unsigned long)total_bytes, now_s() - t0);
	unreg(&target);
	fi_close(&ep->fid);
	fi_close(&av->fid);
	fi_close(&cq->fid);
	fi_close(&domain->fid);
	fi_close(&fabric->fid);
	fi_freeinfo(info);
	fi_freeinfo(hints);
	return 0;
}
