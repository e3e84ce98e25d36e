#!/bin/sh
# The official Redis image's entrypoint (docker-library/redis), with setpriv for su-exec, and protected
# mode off as the official image's build makes it (unless a config file or the arguments set it).
set -e

# first arg is `-f` or `--some-option`, or `something.conf`
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
	set -- redis-server "$@"
fi

# allow the container to be started with `--user`
if [ "$1" = 'redis-server' ] && [ "$(id -u)" = '0' ]; then
	find . \! -user redis -exec chown redis '{}' +
	exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi

if [ "$1" = 'redis-server' ]; then
	case "${2:-}" in
		'' | -*) # no config file: the official image's built-in default, unless the arguments set it
			case " $* " in
				*" --protected-mode "*) ;;
				*) shift; set -- redis-server --protected-mode no "$@" ;;
			esac ;;
	esac
fi

# set an appropriate umask (if one isn't set already)
um="$(umask)"
if [ "$um" = '0022' ]; then
	umask 0077
fi

exec "$@"
