#!/usr/bin/awk -f
# Draws latency and bandwidth against message size as one SVG (two panels, log-scaled axes),
# one curve per configuration. Input lines: "<config> <size-bytes> <usec/xfer> <MB/sec>";
# configuration names must not contain spaces. Used by scripts/compare-pingpong.sh -g FILE.
#
#   awk -v title="RDM ping-pong, loopback" -f scripts/plot-svg.awk data.txt > plot.svg

function lg(x) { return log(x) / log(10) }
function fmt_size(b) {
    if (b >= 1048576) return (b / 1048576) "M"
    if (b >= 1024) return (b / 1024) "K"
    return b
}
function esc(s) { gsub(/&/, "\\&amp;", s); gsub(/</, "\\&lt;", s); gsub(/>/, "\\&gt;", s); return s }

NF >= 4 && $2 > 0 && $3 > 0 && $4 > 0 {
    c = $1
    if (!(c in seen)) { seen[c] = 1; order[++nc] = c }
    n[c]++
    xs[c, n[c]] = $2; lat[c, n[c]] = $3; bw[c, n[c]] = $4
    if (xmin == "" || $2 < xmin) xmin = $2
    if (xmax == "" || $2 > xmax) xmax = $2
    if (lmin == "" || $3 < lmin) lmin = $3
    if (lmax == "" || $3 > lmax) lmax = $3
    if (bmin == "" || $4 < bmin) bmin = $4
    if (bmax == "" || $4 > bmax) bmax = $4
}

# One panel: log x (size), log y; `which` is "lat" or "bw".
function panel(ox, which, label, ymin, ymax,    i, k, c, x, y, px, py, pts, d, t, lx0, lx1, ly0, ly1) {
    pw = 420; ph = 300
    lx0 = lg(xmin); lx1 = lg(xmax); if (lx1 == lx0) lx1 = lx0 + 1
    ly0 = int(lg(ymin)); if (lg(ymin) < ly0) ly0--
    ly1 = int(lg(ymax)) + 1
    printf "<g transform=\"translate(%d,56)\">\n", ox
    printf "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#999\"/>\n", pw, ph
    for (d = ly0; d <= ly1; d++) {
        py = ph - (d - ly0) / (ly1 - ly0) * ph
        printf "<line x1=\"0\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n", pw, py, py
        printf "<text x=\"-6\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%s</text>\n", py + 4, 10 ^ d
    }
    for (i = 1; i <= nsz; i++) {
        px = (lg(sz[i]) - lx0) / (lx1 - lx0) * pw
        printf "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"0\" y2=\"%d\" stroke=\"#eee\"/>\n", px, px, ph
        printf "<text x=\"%.1f\" y=\"%d\" font-size=\"11\" text-anchor=\"middle\">%s</text>\n", px, ph + 16, fmt_size(sz[i])
    }
    printf "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">message size (bytes)</text>\n", pw / 2, ph + 34
    printf "<text x=\"%d\" y=\"-10\" font-size=\"13\" text-anchor=\"middle\">%s</text>\n", pw / 2, label
    for (k = 1; k <= nc; k++) {
        c = order[k]; pts = ""
        for (i = 1; i <= n[c]; i++) {
            x = xs[c, i]; y = (which == "lat") ? lat[c, i] : bw[c, i]
            px = (lg(x) - lx0) / (lx1 - lx0) * pw
            py = ph - (lg(y) - ly0) / (ly1 - ly0) * ph
            pts = pts sprintf("%.1f,%.1f ", px, py)
            printf "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", px, py, col[k]
        }
        printf "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", pts, col[k], (k == 1) ? "" : " stroke-dasharray=\"6,3\""
    }
    print "</g>"
}

END {
    if (nc == 0) { print "plot-svg.awk: no data" > "/dev/stderr"; exit 1 }
    split("#d62728 #1f77b4 #2ca02c #9467bd #ff7f0e #8c564b", col, " ")
    # The distinct sizes, sorted.
    for (k = 1; k <= nc; k++) for (i = 1; i <= n[order[k]]; i++) allsz[xs[order[k], i]] = 1
    nsz = 0; for (s in allsz) sz[++nsz] = s + 0
    for (i = 2; i <= nsz; i++) { v = sz[i]; j = i - 1; while (j > 0 && sz[j] > v) { sz[j + 1] = sz[j]; j-- } sz[j + 1] = v }
    W = 1000; H = 456
    printf "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\">\n", W, H
    printf "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
    printf "<text x=\"%d\" y=\"18\" font-size=\"14\" text-anchor=\"middle\">%s</text>\n", W / 2, esc(title)
    panel(60, "lat", "one-way latency (usec/xfer, log)", lmin, lmax)
    panel(560, "bw", "bandwidth (MB/sec, log)", bmin, bmax)
    for (k = 1; k <= nc; k++) {
        printf "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", 70 + (k - 1) * 180, 95 + (k - 1) * 180, H - 14, H - 14, col[k], (k == 1) ? "" : " stroke-dasharray=\"6,3\""
        printf "<text x=\"%d\" y=\"%d\" font-size=\"12\">%s</text>\n", 100 + (k - 1) * 180, H - 10, esc(order[k])
    }
    print "</svg>"
}
