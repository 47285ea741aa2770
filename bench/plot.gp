# bench/plot.gp: bench/throughput.png from the medians bench/run.lua
# measured.  Called as
#   gnuplot -e "data='<file>'; out='<png>'; bound=<tps>; raw=<tps>" bench/plot.gp
# <file> has one line per mode: index "key" median min max (transfers/s).
set terminal pngcairo size 1200,640 font ",10"
set output out
set title "mongotx transfers/s per mode (median of runs, bars min-max; log scale)"
set ylabel "transfers/s"
set logscale y
set grid ytics
set xtics rotate by -40 left noenhanced
set style fill solid 0.6 border -1
set boxwidth 0.7
set key top right
set bmargin 9
set rmargin 8
plot data using 1:3:4:5:(0.7):xtic(2) with boxerrorbars lc rgb "#4878a8" title "median (min-max)", \
     raw with lines dt 2 lc rgb "#888888" title "raw $inc x2", \
     bound with lines dt 1 lw 2 lc rgb "#c04040" title "write-count bound (raw x 2/7)", \
     0.8 * bound with lines dt 3 lc rgb "#c04040" title "target: 0.8 x bound"
