#import "wsrm.h"
#import "rmtest.h"
