
function done_one() {
  if (!have) return
  if (rq > 0 || sq > 0 || snd < quiet || rcv < quiet) {
    busy++; sub(/:[0-9]+$/, "", peer); by[peer]++
  } else idle++
  have = 0
}
/^[0-9]/ { done_one(); have = 1; rq = $1; sq = $2; peer = $4; snd = 0; rcv = 0; next }
{ for (i = 1; i <= NF; i++) {
    if ($i ~ /^lastsnd:/) snd = substr($i, 9) + 0
    if ($i ~ /^lastrcv:/) rcv = substr($i, 9) + 0
} }
END { done_one(); printf "%d %d", busy, idle; for (p in by) printf " %s x%d", p, by[p]; print "" }
