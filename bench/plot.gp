# bench/plot.gp: bench/throughput.png from the medians bench/run.lua
# measured.  Called as
#   gnuplot -e "data='<file>'; out='<png>'; cols=<n>" bench/plot.gp
# <file>: a header line of quoted titles, then one line per latency
# (loopback, +0.2 ms, +1 ms): its name, the transfers/s of each mode, and
# last (column cols) the 7-writes bound at that latency; "?" when missing.
set terminal pngcairo size 1200,700 font ",10"
set output out
set title "mongotx transfers/s per mode at each round trip (median of runs; log scale)"
set ylabel "transfers/s"
set xlabel "round trip added to loopback (toxiproxy latency toxics)"
set logscale y
set grid ytics mytics
set datafile missing "?"
set key outside right top noenhanced
set offsets 0.2, 0.2, 0, 0
plot for [i=2:cols-1] data using 0:i:xtic(1) with linespoints lw 2 pt 7 ps 1.2 title columnhead(i), \
     data using 0:cols with linespoints dt 2 lw 3 pt 5 lc rgb "#c04040" title columnhead(cols)
